"""`previous_response_id` routing (routing.peers.response_affinity), with the official `openai`
client, through the real router, against simulated workers that keep their responses as
vLLM does (simulator.responses_api): a follow-up, GET or cancel sent to any other worker
fails with vLLM's 404, so every success here was routed to the holder. Two replicas share
the ids through Redis (where REDIS_URL names one)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.utils import timezone

from controlpanel.fleet import services
from controlpanel.registry.models import RouterInstance, Worker
from simulator.responses_api import store_of
from simulator.server import RunningSimulator
from tests.support.common import REDIS_URL, needs_redis
from tests.support.replicas import join, sees
from tests.support.servers import (
    RouterServer,
    StartSimulator,
    start_router,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)
MODEL = "resp-model"


def holder(sims: list[RunningSimulator], response_id: str) -> int:
    """The index of the one simulator that stored `response_id`."""
    held = [i for i, s in enumerate(sims) if response_id in store_of(s.state).responses]
    assert len(held) == 1, (response_id, held)
    return held[0]


def openai_client(router: RouterServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, str]:
    """(the id from response.created, the id from response.completed) of a streamed call."""
    created = completed = ""
    for event in client.responses.create(model=MODEL, stream=True, **kwargs):
        if event.type == "response.created":
            created = event.response.id
        elif event.type == "response.completed":
            completed = event.response.id
    return created, completed


def access_line(router: RouterServer, request_id: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        for line in router.log().splitlines():
            if line.startswith("{") and request_id in line:
                entry: dict[str, Any] = json.loads(line)
                if entry.get("request_id") == request_id:
                    return entry
        return None

    wait_until(lambda: found() is not None)
    entry = found()
    assert entry is not None
    return entry


@pytest.fixture
def fleet(
    router: RouterServer, simulator: StartSimulator, add_worker: Callable[..., Worker]
) -> tuple[list[RunningSimulator], list[Worker]]:
    sims = [simulator(MODEL) for _ in range(3)]
    return sims, [add_worker(s) for s in sims]


def test_follow_ups_streamed_and_not_reach_the_worker_holding_the_response(
    router: RouterServer, fleet: tuple[list[RunningSimulator], list[Worker]]
) -> None:
    sims, _ = fleet
    client = openai_client(router)
    firsts = [client.responses.create(model=MODEL, input=f"hello {i}", max_output_tokens=3)
              for i in range(6)]  # fmt: skip
    homes = [holder(sims, r.id) for r in firsts]
    assert len(set(homes)) >= 2, homes  # spread out, so a wrong route would show
    for first, home in zip(firsts, homes, strict=True):
        second = client.responses.create(
            model=MODEL, input="and then?", previous_response_id=first.id, max_output_tokens=3
        )
        assert second.previous_response_id == first.id
        assert holder(sims, second.id) == home
        created, completed = streamed(
            client, input="go on", previous_response_id=second.id, max_output_tokens=3
        )
        assert created == completed and holder(sims, created) == home
        third = client.responses.create(
            model=MODEL, input="last", previous_response_id=created, max_output_tokens=2
        )
        assert holder(sims, third.id) == home


def test_an_unknown_previous_id_is_routed_as_usual_and_the_worker_says_404(
    router: RouterServer, fleet: tuple[list[RunningSimulator], list[Worker]]
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client(router).responses.create(
            model=MODEL, input="hi", previous_response_id="resp_never_made"
        )
    assert caught.value.body == {  # vLLM's own, from the worker
        "message": "Response with id 'resp_never_made' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }


def test_get_and_cancel_go_to_the_holder(
    router: RouterServer, simulator: StartSimulator, add_worker: Callable[..., Worker]
) -> None:
    # Slow workers, so a background response is still running when it is cancelled.
    sims = [simulator(MODEL, itl_ms=50) for _ in range(3)]
    for s in sims:
        add_worker(s)
    client = openai_client(router)
    done = client.responses.create(model=MODEL, input="quick", max_output_tokens=1)
    assert client.responses.retrieve(done.id).id == done.id
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(done.id)  # the holder's answer: any other says 404
    running = client.responses.create(
        model=MODEL, input="long", max_output_tokens=200, background=True
    )
    assert running.status == "queued"
    assert client.responses.retrieve(running.id).status in ("queued", "in_progress")
    assert client.responses.cancel(running.id).status == "cancelled"
    assert client.responses.retrieve(running.id).status == "cancelled"
    with pytest.raises(openai.NotFoundError, match="Response with id 'resp_nope' not found"):
        client.responses.retrieve("resp_nope")


def test_a_gone_holder_is_an_error_that_says_so_never_another_worker(
    router: RouterServer, fleet: tuple[list[RunningSimulator], list[Worker]]
) -> None:
    sims, workers = fleet
    client = openai_client(router)
    first = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    drained = workers[holder(sims, first.id)]
    # Another router with a request still on that worker holds the drain open; else this
    # router's first report after the drain may finish it between two of the calls below.
    RouterInstance.objects.create(
        instance_id="a-router-still-busy", hostname="elsewhere", pid=1,
        started_at=timezone.now(), last_seen=timezone.now(), inflight={str(drained.pk): 1},
    )  # fmt: skip
    services.worker_drain(worker_id=drained.pk, actor="test")
    router.wait_snapshot()
    received = [s.state.received for s in sims]
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(
            model=MODEL, input="more", previous_response_id=first.id, max_output_tokens=2
        )
    message = str(caught.value)
    assert first.id in message and drained.name in message and "draining" in message
    assert [s.state.received for s in sims] == received  # nobody was asked
    assert client.responses.retrieve(first.id).id == first.id  # a draining worker still holds it
    services.worker_remove(worker_id=drained.pk, actor="test")
    router.wait_snapshot()
    for call in (
        lambda: client.responses.create(model=MODEL, input="x", previous_response_id=first.id),
        lambda: client.responses.retrieve(first.id),
    ):
        with pytest.raises(openai.NotFoundError, match="has left the fleet"):
            call()
    assert [s.state.received for s in sims] == received


def test_explain_and_the_access_log_show_the_pin(
    router: RouterServer, fleet: tuple[list[RunningSimulator], list[Worker]]
) -> None:
    sims, workers = fleet
    first = openai_client(router).responses.create(model=MODEL, input="hi", max_output_tokens=2)
    home = workers[holder(sims, first.id)]
    body = {"model": MODEL, "input": "again", "previous_response_id": first.id}
    response = router.post("/v1/responses", json=body, headers={"X-Route-Explain": "1"})
    assert response.status_code == 200, response.text
    told = json.loads(response.headers["x-route-explain"])
    assert told["decision"] == "previous_response" and told["worker"] == home.name
    assert told["candidates"][0]["response_id"] == first.id
    line = access_line(router, response.headers["x-request-id"])
    assert line["pinned"] == {"response_id": first.id, "found_in": "memory", "lookup_ms": None}
    assert line["worker"] == home.name
    got = router.get(f"/v1/responses/{first.id}", headers={"X-Route-Explain": "1"})
    assert got.status_code == 200 and json.loads(got.headers["x-route-explain"])["worker"]
    assert access_line(router, got.headers["x-request-id"])["pinned"]["response_id"] == first.id


# -- two replicas sharing Redis ------------------------------------------------------------------


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Callable[[int], list[RouterServer]]]:
    started: list[RouterServer] = []

    def start(count: int) -> list[RouterServer]:
        fresh = [start_router(tmp_path, REDIS_URL=REDIS_URL) for _ in range(count)]
        started.extend(fresh)
        return fresh

    yield start
    for server in started:
        stop_process(server.proc)


@needs_redis
def test_a_follow_up_through_the_other_replica_reaches_the_holder_at_once(
    replicas: Callable[[int], list[RouterServer]], simulator: StartSimulator
) -> None:
    first, second = replicas(2)
    sims = [simulator(MODEL, itl_ms=20) for _ in range(3)]
    join(sims, first, second)
    wait_until(lambda: sees(first, second) and sees(second, first))
    a, b = openai_client(first), openai_client(second)
    for i in range(6):
        made = a.responses.create(model=MODEL, input=f"hi {i}", max_output_tokens=2)
        home = holder(sims, made.id)
        # No pause: the id was in Redis before the client had it.
        again = b.responses.create(
            model=MODEL, input="more", previous_response_id=made.id, max_output_tokens=2
        )
        created, _ = streamed(a, input="on", previous_response_id=again.id, max_output_tokens=2)
        assert holder(sims, again.id) == home == holder(sims, created)
    # A background response polled and cancelled through the other replica, milliseconds on.
    running = a.responses.create(model=MODEL, input="x", max_output_tokens=200, background=True)
    assert b.responses.retrieve(running.id).status in ("queued", "in_progress")
    assert b.responses.cancel(running.id).status == "cancelled"
    # A replica started later has heard nothing: one Redis lookup, then memory.
    (late,) = replicas(1)
    late.wait_routable(*Worker.objects.all())
    body = {"model": MODEL, "input": "late", "previous_response_id": made.id}
    for found_in in ("redis", "memory"):
        got = httpx.post(f"{late.url}/v1/responses", json=body, timeout=30)
        assert got.status_code == 200, got.text
        line = access_line(late, got.headers["x-request-id"])
        assert line["pinned"]["found_in"] == found_in, line
        assert holder(sims, got.json()["id"]) == holder(sims, made.id)
