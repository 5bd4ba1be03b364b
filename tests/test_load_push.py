"""Pushed in-flight counts (routing.load_push): routers at a saturated pool agree at once.

The merge rules are checked on a real LoadBoard; the behaviour end to end, with two router
processes on the test database and a real Redis, simulated workers with one batch slot each
and the official openai client (CI's second tier runs it; it fails there rather than skips).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from urllib.parse import urlsplit

import msgpack
import openai
import pytest
import redis.asyncio as aioredis

from controlpanel.rollouts import aliases
from routing.load_push import DELIVERY_WAIT_SECONDS, LoadPush
from routing.load_signal import LoadBoard
from routing.shared_store import SharedStore
from simulator.server import RunningSimulator
from tests.conftest import RouterServer, StartSimulator, wait_until
from tests.test_many_routers import (
    REDIS_URL,
    join,
    metric,
    needs_redis,
    routers,
    sees,
    use_policy,
)
from tests.test_store_outage import TcpRelay

__all__ = ["routers"]  # the fixture, used by name
PUSHES = "controlpanel_router_shared_load_pushes_total"


def board_with(peer_counts: dict[int, int]) -> tuple[LoadPush, LoadBoard]:
    own: defaultdict[int, int] = defaultdict(int)
    board = LoadBoard(own)
    push = LoadPush("me", own, board, SharedStore("redis://127.0.0.1:1/0"), None)  # type: ignore[arg-type]
    board.others = push.merge_hash({"peer": (5, peer_counts)})
    board.refresh(time.time(), [1, 2])
    return push, board


def message(sender: str, seq: int, counts: dict[int, int]) -> bytes:
    return sender.encode() + b" " + msgpack.packb([seq, counts])


def test_a_pushed_change_moves_the_load_at_once_and_an_older_hash_does_not_undo_it() -> None:
    push, board = board_with({1: 3, 2: 1})
    assert board.loads == {1: 3, 2: 1}
    version = board.loads.version
    push.apply(message("peer", 6, {1: 2}))
    assert board.loads[1] == 2 and board.loads.version > version  # a fall re-reads indexes
    # The hash written before that message (seq 5) arrives later: the push stays.
    assert push.merge_hash({"peer": (5, {1: 3, 2: 1})}) == {1: 2, 2: 1}
    # A hash written after it (seq 6, newer counts) replaces it.
    assert push.merge_hash({"peer": (6, {2: 1})}) == {2: 1}


def test_own_stale_unknown_and_malformed_messages_change_nothing() -> None:
    push, board = board_with({1: 3})
    push.apply(message("me", 9, {1: 0}))  # its own, back from the channel
    push.apply(message("peer", 4, {1: 0}))  # older than what is known
    push.apply(message("stranger", 1, {1: 0}))  # not live in the hash yet
    assert board.loads[1] == 3 and push.received == 0
    for bad in (b"peer \xc1", message("peer", 6, [1, 2]), b"peer " + msgpack.packb([7]), b""):
        push.take(bad)  # type: ignore[arg-type]
    assert push.malformed == 4 and board.loads[1] == 3
    push.apply(message("peer", 6, {1: 2}))  # the bad seq-6 message took nothing
    assert board.loads[1] == 2


def test_a_missed_message_lets_the_next_hash_win_whatever_its_number() -> None:
    push, _ = board_with({1: 3})
    push.apply(message("peer", 8, {1: 1}))  # 6 and 7 were missed
    assert push.merge_hash({"peer": (7, {1: 2})}) == {1: 2}


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
    first router holds the other and ends; the client's next request, through the second
    router 10 ms later (a fifth of a sync tick), must take the freed slot, not queue behind
    the long stream. Counts shared only by the 50 ms tick get this right about half the time
    (the two workers look equally loaded), so six trials in a row fail it."""
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
        stream(one, 60)  # the other worker's slot, about 0.3 s: every tick sees it
        time.sleep(0.01)
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


def test_pushing_is_a_no_op_until_another_router_is_live() -> None:
    own: defaultdict[int, int] = defaultdict(int)
    push = LoadPush("me", own, LoadBoard(own), SharedStore("redis://127.0.0.1:1/0"), None)  # type: ignore[arg-type]
    push.changed(1)
    assert not push._dirty
    push.active = True
    push.changed(1)
    assert push._dirty == {1}


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
        wait_until(lambda: sees(second, first) and sees(first, second), timeout=10)
        before = pushed_in()

        def resumed() -> bool:
            stream(client, 2)
            return pushed_in() > before

        wait_until(resumed, timeout=10)
        assert (
            metric(first, "controlpanel_router_shared_load_pushes_total", direction="malformed")
            == 0
        )
    finally:
        relay.down()


def test_delivered_returns_at_once_when_nothing_is_pending() -> None:
    push, _ = board_with({})

    async def scenario() -> float:
        start = time.perf_counter()
        push.changed(1)  # not active (no other router): nothing to tell
        await push.delivered()
        return time.perf_counter() - start

    assert asyncio.run(scenario()) < DELIVERY_WAIT_SECONDS / 2


def active_push(url: str) -> tuple[LoadPush, aioredis.Redis]:
    own: defaultdict[int, int] = defaultdict(int)
    client = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    push = LoadPush("me", own, LoadBoard(own), SharedStore(url), client)
    push.active = True
    push.set_channel("controlpanel:test-delivered:loads")
    own[1] = 1
    return push, client


@needs_redis
def test_delivered_returns_once_redis_has_taken_the_message() -> None:
    """What routing.proxy waits for before a stream's last event: the subscribers have the
    message by the time it returns."""

    async def scenario() -> tuple[int, dict[str, object] | None]:
        push, client = active_push(REDIS_URL)
        listener = aioredis.Redis.from_url(REDIS_URL).pubsub()
        await listener.subscribe(push.channel)
        await listener.get_message(timeout=1)  # the subscription's confirmation
        await push.start()
        try:
            await asyncio.sleep(0.05)  # past the sender's minimum gap
            push.changed(1)
            await push.delivered()
            sent = push.sent
            got = await listener.get_message(timeout=1)
        finally:
            await push.stop()
            await listener.aclose()
            await client.aclose()
        return sent, got

    sent, got = asyncio.run(scenario())
    assert sent == 1
    assert got is not None and msgpack.unpackb(
        got["data"].split(b" ", 1)[1], strict_map_key=False
    ) == [
        1,
        {1: 1},
    ]


def test_delivered_gives_up_when_redis_does_not_answer() -> None:
    """A Redis that accepts and never answers delays a stream's end by the cap, no more."""

    async def scenario() -> tuple[float, int]:
        silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        push, client = active_push(f"redis://127.0.0.1:{port}/0")
        await push.start()
        try:
            push.changed(1)
            start = time.perf_counter()
            await push.delivered()
            waited = time.perf_counter() - start
        finally:
            await push.stop()
            await client.aclose()
            silent.close()
        return waited, push.sent

    waited, sent = asyncio.run(scenario())
    assert sent == 0
    assert DELIVERY_WAIT_SECONDS * 0.9 <= waited < DELIVERY_WAIT_SECONDS + 0.5
