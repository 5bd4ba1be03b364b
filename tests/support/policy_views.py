"""The balancing policies in process: a fleet of WorkerViews, plain in-flight counts as loads,
requests (with a session key as the router reads it), and counting a policy's choices over
many calls, one by one or as the router makes them (start and completion hooks included)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.common.workers import worker_view
from routing.fleet.snapshot import WorkerView
from routing.policies.base import BasePolicy, RequestInfo
from routing.policies.load import load_of
from routing.sessions import SessionReader, key_of

NO_INFLIGHT: Mapping[int, int] = {}
REQUEST = RequestInfo(model="m", body={}, raw_headers=(), text="hello")


def worker(worker_id: int, **changes: Any) -> WorkerView:
    return worker_view(worker_id, **changes)


def fleet(n: int, **changes: Any) -> tuple[WorkerView, ...]:
    return tuple(worker(i, **changes) for i in range(1, n + 1))


def counts(
    policy: BasePolicy,
    workers: Sequence[WorkerView],
    calls: int,
    inflight: Mapping[int, int] = NO_INFLIGHT,
    request: RequestInfo = REQUEST,
) -> Counter[int]:
    picked: Counter[int] = Counter()
    for _ in range(calls):
        chosen = policy.select(workers, request, inflight).worker
        assert chosen is not None
        picked[chosen.id] += 1
    return picked


def pick(
    policy: BasePolicy,
    workers: Sequence[WorkerView],
    request: RequestInfo,
    inflight: Mapping[int, int],
) -> WorkerView:
    chosen = policy.select(workers, request, inflight).worker
    assert chosen is not None
    return chosen


def session(
    key: str | None = None, user: str | None = None, header: bytes = b"x-session-id"
) -> RequestInfo:
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((header, key.encode("latin-1")))
    body: dict[str, Any] = {"model": "m", "messages": []}
    if user is not None:
        body["user"] = user
    # The session key as the router reads it once per request (routing.sessions).
    found = SessionReader().read(headers, body)
    return RequestInfo(model="m", body=body, raw_headers=headers, session=key_of(found))


BIG = 300  # > INDEX_MIN_WORKERS: policies go through a LoadIndex


def loads_of(workers: Sequence[WorkerView], inflight: Mapping[int, int]) -> list[int]:
    return [load_of(w, inflight) for w in workers]


def router_traffic(
    policy: BasePolicy,
    workers: Sequence[WorkerView],
    steps: int,
    rng: random.Random,
    inflight: Counter[int],
    check: Callable[[WorkerView, list[int]], None],
) -> None:
    """Decisions as the router makes them: +1 before on_request_start, -1 before
    on_request_complete (a random request in flight completes now and then). `check(chosen,
    loads before)` runs after every decision."""
    running: list[WorkerView] = []
    for _ in range(steps):
        before = loads_of(workers, inflight)
        chosen = pick(policy, workers, REQUEST, inflight)
        check(chosen, before)
        inflight[chosen.id] += 1
        policy.on_request_start(chosen, REQUEST)
        running.append(chosen)
        while running and rng.random() < 0.45:
            done = running.pop(rng.randrange(len(running)))
            inflight[done.id] -= 1
            policy.on_request_complete(done, REQUEST, True)
