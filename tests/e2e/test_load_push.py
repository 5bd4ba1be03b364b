"""Pushed in-flight counts (routing.peers.load_push) end to end: routers at a saturated pool
agree at once. Two router processes on the test database and a real Redis, simulated
workers with one batch slot each and the official openai client (CI's second tier runs
it; it fails there rather than skips)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from urllib.parse import urlsplit

import openai
import pytest

from controlpanel.rollouts import aliases
from simulator.server import RunningSimulator
from tests.support.common import REDIS_URL, needs_redis
from tests.support.relays import TcpRelay
from tests.support.replicas import join, metric, sees, use_policy
from tests.support.servers import RouterServer, StartSimulator, wait_until

PUSHES = "controlpanel_router_shared_load_pushes_total"


def hold(client: openai.OpenAI, release: threading.Event) -> None:
    """A stream that holds its batch slot (up to 20 s) until `release` is set, then hangs
    up: a loaded machine may take a while to show it, and it must not end before the test
    has looked."""
    with client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "go"}], max_tokens=4000, stream=True
    ) as chunks:
        for _ in chunks:
            if release.is_set():
                break


def stream(client: openai.OpenAI, tokens: int) -> None:
    chunks = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "go"}], max_tokens=tokens, stream=True
    )
    for _ in chunks:
        pass


@needs_redis
@pytest.mark.django_db(transaction=True)
def test_a_slot_freed_through_one_router_is_taken_at_once_through_the_other(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    """Two workers of one batch slot each. A long stream holds one; a stream through the
    first router holds the other and ends; once the second router counts the freed slot as
    free, the client's next request through it must take that slot, not queue behind the
    long stream. How soon the second router knows (pushed at once, not at the next 50 ms
    tick) is a speed figure, not this test's to time: the pushes are counted instead."""
    first, second = routers(2)
    sims = [simulator("m", ttft_ms=5, itl_ms=5, max_batch=1) for _ in range(2)]
    join(sims, first, second)
    use_policy("shortest_queue", first, second)
    # Other live routers of the suite (the session's) may be peers too: wait for this one.
    wait_until(lambda: sees(second, first) and sees(first, second))
    one, two = (openai.OpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0)
                for r in (first, second))  # fmt: skip
    for trial in range(6):
        release = threading.Event()
        holder = threading.Thread(target=hold, args=(one, release))
        holder.start()
        wait_until(lambda: sum(sim.state.running for sim in sims) == 1)
        held = next(i for i, sim in enumerate(sims) if sim.state.running)
        held_by_id = held_id(first, sims[held])
        wait_until(lambda h=held_by_id: second.workers()[h]["inflight_elsewhere"] == 1)
        freed_id = held_id(first, sims[1 - held])
        stream(one, 60)  # the other worker's slot, about 0.3 s: every tick sees it
        wait_until(lambda f=freed_id: second.workers()[f]["inflight_elsewhere"] == 0)
        before = [sim.state.received for sim in sims]
        # On the held worker it would queue behind the holder: read where it went, then free.
        following = threading.Thread(target=stream, args=(two, 2))
        following.start()
        sent = sum(before)
        wait_until(lambda n=sent: sum(sim.state.received for sim in sims) > n)
        took = [i for i in range(2) if sims[i].state.received > before[i]]
        release.set()
        holder.join()
        following.join()
        assert took == [1 - held], f"trial {trial}: the freed slot was not taken"
        wait_until(lambda: not any(sim.state.running for sim in sims))  # the hang-up freed it
    assert (metric(second, PUSHES, direction="in") or 0) > 0


@needs_redis
@pytest.mark.django_db(transaction=True)
def test_an_alias_stream_through_peers_arrives_whole_and_gives_its_slot_back(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    """With peers live the relay holds `data: [DONE]` until the release is told; through an
    alias (its model renamed in every chunk) the stream still arrives whole, renamed, and
    both routers count the slot free afterwards."""
    first, second = routers(2)
    sims = [simulator("m-real")]
    join(sims, first, second)
    aliases.alias_create(name="chat", targets={"m-real": 100}, actor="test")
    wait_until(lambda: sees(second, first) and sees(first, second))
    wait_until(lambda: "chat" in first.get("/list_models").text)
    client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "go"}], max_tokens=20,
            stream=True,
        )
    )  # fmt: skip
    assert chunks and {chunk.model for chunk in chunks} == {"chat"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    worker = held_id(first, sims[0])
    wait_until(
        lambda: (
            first.workers()[worker]["inflight_here"] == 0
            and second.workers()[worker]["inflight_elsewhere"] == 0
        )
    )


def held_id(router: RouterServer, sim: RunningSimulator) -> int:
    return next(w["id"] for w in router.workers().values() if w["url"] == sim.url)


@needs_redis
@pytest.mark.django_db(transaction=True)
def test_pushes_stop_while_redis_is_away_and_resume_when_it_is_back(
    routers: Callable[..., list[RouterServer]], simulator: StartSimulator
) -> None:
    """Both routers reach Redis through a relay that is cut and restored: requests are
    served meanwhile, and the subscriber resubscribes by itself afterwards."""
    target = urlsplit(REDIS_URL)
    relay = TcpRelay((target.hostname or "127.0.0.1", target.port or 6379))
    try:
        via_relay = REDIS_URL.replace(target.netloc, f"127.0.0.1:{relay.port}")
        first, second = routers(2, REDIS_URL=via_relay)
        sims = [simulator("m", max_batch=8) for _ in range(2)]
        join(sims, first, second)
        wait_until(lambda: sees(second, first) and sees(first, second))
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="x", max_retries=0)

        def pushed_in() -> float:
            return (
                metric(second, "controlpanel_router_shared_load_pushes_total", direction="in") or 0
            )

        stream(client, 2)
        wait_until(lambda: pushed_in() > 0)
        relay.down()
        wait_until(lambda: not second.get("/health").json()["shared_state"]["up"])
        for _ in range(5):
            stream(client, 2)  # served from local state
        relay.up()
        wait_until(lambda: sees(second, first) and sees(first, second))
        before = pushed_in()

        def resumed() -> bool:
            stream(client, 2)
            return pushed_in() > before

        wait_until(resumed)
        assert (
            metric(first, "controlpanel_router_shared_load_pushes_total", direction="malformed")
            == 0
        )
    finally:
        relay.down()
