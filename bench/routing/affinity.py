"""The session affinity phase of ``bench.routing``: stickiness, then a drain.

A library for that script, not a script: the phase's workload (short prompts, a pause between
a session's turns; :func:`affinity_workload`), which worker served which request, learnt by
polling every worker's ``/sim/stats`` request log for the ``X-Request-Id`` sent
(:class:`AffinityLog`, :func:`poll_request_logs`), the drain of the worker that is home to most
sessions halfway through and its activation afterwards (:func:`affinity_phase`), and the
figures the report and the targets read (:func:`summarize_affinity`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp
import orjson

from bench.common.router_api import listed_workers
from bench.routing.fleet import Fleet, admin_headers
from bench.routing.load import Outcome, Samples, run_sessions
from bench.routing.readings import reset_workers
from bench.routing.workloads import Scale, Session, Words, Workload
from harness.fleet import wait_ready

# Short prompts, so polling the workers' request logs stays cheap.
AFFINITY_CONCURRENCY = 8
AFFINITY_SYSTEM_WORDS = 48
AFFINITY_USER_WORDS = (8, 16)
AFFINITY_POLL_S = 0.1
AFFINITY_THINK_S = 0.25  # pause between a session's turns, so the phase outlasts the drain
SIM_LOG_WINDOW = 50  # /sim/stats shows the last 50 logged requests per worker


def affinity_workload(scale: Scale, seed: int) -> Workload:
    rng = random.Random(f"{seed}-affinity")
    words = Words(rng)
    n_groups = 8
    systems = [words.text(AFFINITY_SYSTEM_WORDS) for _ in range(n_groups)]
    sessions = tuple(
        Session(
            f"aff-{i:02d}",
            i % n_groups,
            systems[i % n_groups],
            tuple(words.between(AFFINITY_USER_WORDS) for _ in range(scale.affinity_turns)),
        )
        for i in range(scale.affinity_sessions)
    )
    return Workload(
        "affinity",
        f"{scale.affinity_sessions} sessions x {scale.affinity_turns} turns, short prompts, "
        f"{AFFINITY_THINK_S * 1000:.0f} ms between a session's turns, at most "
        f"{AFFINITY_CONCURRENCY} in flight",
        sessions,
    )


# --------------------------------------------------------------------------- affinity phase


@dataclass
class AffinityLog:
    """Which worker served which request, learnt from the workers' request logs."""

    sent: dict[str, tuple[str, int, float]] = field(default_factory=dict)  # rid -> (key, k, t)
    served_by: dict[str, int] = field(default_factory=dict)  # rid -> worker index
    failed: dict[str, str] = field(default_factory=dict)
    possibly_missed: int = 0  # a poll found a full log window of unseen entries

    def record(self, rid: str, s: Session, k: int, t: float) -> None:
        self.sent[rid] = (s.key, k, t)

    def done(self, rid: str, result: Outcome) -> None:
        if not result.ok:
            self.failed[rid] = result.error


async def poll_request_logs(
    http: aiohttp.ClientSession, fleet: Fleet, alog: AffinityLog, tag: str, stop: asyncio.Event
) -> None:
    """Every AFFINITY_POLL_S read each worker's last 50 logged requests; bounded by `stop`
    and a deadline."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        final = stop.is_set()
        for index, url in enumerate(fleet.workers):
            async with http.get(url + "/sim/stats") as resp:
                entries = orjson.loads(await resp.read())["requests"]
            unseen = 0
            for entry in entries:
                headers = {k.lower(): v for k, v in entry["headers"].items()}
                rid = headers.get("x-request-id", "")
                if entry["path"] == "/v1/chat/completions" and rid.startswith(tag):
                    if rid not in alog.served_by:
                        unseen += 1
                    alog.served_by[rid] = index
            if unseen >= SIM_LOG_WINDOW:
                alog.possibly_missed += 1
        if final:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), AFFINITY_POLL_S)


async def routable(http: aiohttp.ClientSession, fleet: Fleet, worker_id: int) -> bool:
    workers = await listed_workers(http, fleet.router)
    return any(w["id"] == worker_id and w["routable"] for w in workers)


async def worker_state(http: aiohttp.ClientSession, fleet: Fleet, worker_id: int) -> str:
    url = f"{fleet.router}/api/workers/{worker_id}"
    async with http.get(url, headers=admin_headers(fleet)) as resp:
        return str(orjson.loads(await resp.read()).get("state", "?"))


def home_workers(
    alog: AffinityLog, rids: list[str]
) -> tuple[dict[str, Counter[int]], dict[str, int]]:
    """Per session: how many of the given requests each worker served, and the most used."""
    per: dict[str, Counter[int]] = {}
    for rid in rids:
        if rid in alog.served_by:
            per.setdefault(alog.sent[rid][0], Counter())[alog.served_by[rid]] += 1
    homes = {key: c.most_common(1)[0][0] for key, c in per.items()}
    return per, homes


async def affinity_phase(
    http: aiohttp.ClientSession, fleet: Fleet, workload: Workload
) -> dict[str, Any]:
    """Stickiness while all workers are healthy, then a drain halfway through."""
    await reset_workers(http, fleet)
    tag = "aff"
    alog = AffinityLog()
    total = workload.requests
    completed = 0
    drain: dict[str, Any] = {}
    drain_started = asyncio.Event()

    def on_done(rid: str, result: Outcome) -> None:
        nonlocal completed
        completed += 1
        alog.done(rid, result)
        if completed >= total // 2 and not drain_started.is_set():
            drain_started.set()

    stop = asyncio.Event()
    poller = asyncio.create_task(poll_request_logs(http, fleet, alog, tag, stop))
    drain_task = asyncio.create_task(drain_busiest(http, fleet, alog, drain, drain_started))
    try:
        samples, wall = await run_sessions(
            workload,
            lambda s: fleet.router,
            AFFINITY_CONCURRENCY,
            tag,
            alog.record,
            on_done,
            think_s=AFFINITY_THINK_S,
        )
        await asyncio.wait_for(drain_task, 30)
    finally:
        drain_task.cancel()
        stop.set()
        await asyncio.wait_for(poller, 30)
    if drain.get("worker_id") is not None:
        await reactivate(http, fleet, drain)
    return summarize_affinity(alog, samples, wall, drain)


async def drain_busiest(
    http: aiohttp.ClientSession,
    fleet: Fleet,
    alog: AffinityLog,
    drain: dict[str, Any],
    started: asyncio.Event,
) -> None:
    """Once `started` is set, drain the worker that is home to most sessions so far and wait
    (10 s at most) until the router stops routing to it; what happened goes into `drain`."""
    await started.wait()
    _, homes = home_workers(alog, list(alog.sent))
    victim = Counter(homes.values()).most_common(1)[0][0] if homes else 0
    worker_id = fleet.worker_ids[victim]
    drain["victim"] = victim
    drain["worker_id"] = worker_id
    drain["t_request"] = time.monotonic()
    url = f"{fleet.router}/api/workers/{worker_id}/drain"
    async with http.post(url, headers=admin_headers(fleet)) as resp:
        drain["drain_status"] = resp.status
        drain["state_after_post"] = orjson.loads(await resp.read()).get("state")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and await routable(http, fleet, worker_id):
        await asyncio.sleep(0.02)
    drain["t_effective"] = time.monotonic()
    drain["effective_after_s"] = drain["t_effective"] - drain["t_request"]


async def reactivate(http: aiohttp.ClientSession, fleet: Fleet, drain: dict[str, Any]) -> None:
    """After the phase: wait (15 s at most) for the drained worker to reach "drained", then
    activate it and wait until the router routes to it again; the states go into `drain`."""
    worker_id = drain["worker_id"]
    deadline = time.monotonic() + 15
    state = await worker_state(http, fleet, worker_id)
    while state == "draining" and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        state = await worker_state(http, fleet, worker_id)
    drain["state_after_phase"] = state
    drain["drained_after_s"] = time.monotonic() - drain["t_request"]
    url = f"{fleet.router}/api/workers/{worker_id}/activate"
    async with http.post(url, headers=admin_headers(fleet)) as resp:
        drain["activate_status"] = resp.status
    await wait_ready(
        "the drained worker to be routable again",
        partial(routable, http, fleet, worker_id),
        fleet.proc,
        timeout=15,
    )
    drain["state_after_activate"] = await worker_state(http, fleet, worker_id)


def summarize_affinity(
    alog: AffinityLog, samples: Samples, wall: float, drain: dict[str, Any]
) -> dict[str, Any]:
    t_req = drain.get("t_request", math.inf)
    t_eff = drain.get("t_effective", math.inf)
    victim = drain.get("victim", -1)
    healthy = [rid for rid, (_, _, t) in alog.sent.items() if t < t_req]
    after = [rid for rid, (_, _, t) in alog.sent.items() if t >= t_eff]
    per_healthy, homes = home_workers(alog, healthy)
    on_home = sum(c.most_common(1)[0][1] for c in per_healthy.values())
    attributed_healthy = sum(sum(c.values()) for c in per_healthy.values())
    per_after, new_homes = home_workers(alog, after)
    leaked = sum(1 for rid in after if alog.served_by.get(rid) == victim)
    moved = [k for k, h in homes.items() if h == victim and k in per_after]
    moved_sticky = sum(per_after[k].most_common(1)[0][1] for k in moved)
    moved_total = sum(sum(per_after[k].values()) for k in moved)
    stayed = [k for k, h in homes.items() if h != victim and k in per_after]
    stayed_home = sum(per_after[k][homes[k]] for k in stayed)
    stayed_total = sum(sum(per_after[k].values()) for k in stayed)
    transition = [rid for rid, (_, _, t) in alog.sent.items() if t_req <= t < t_eff]
    return {
        "requests": samples.sent,
        "errors": samples.errors,
        "error_kinds": dict(samples.error_kinds),
        "wall_s": wall,
        "attributed": len(alog.served_by),
        "possibly_missed_polls": alog.possibly_missed,
        "healthy_requests": len(healthy),
        "healthy_attributed": attributed_healthy,
        "healthy_sticky_share": on_home / attributed_healthy if attributed_healthy else math.nan,
        "healthy_fully_sticky_sessions": sum(1 for c in per_healthy.values() if len(c) == 1),
        "sessions": len(per_healthy),
        "sessions_per_home": dict(Counter(homes.values())),
        "drain": {k: v for k, v in drain.items() if not k.startswith("t_")},
        "transition_requests": len(transition),
        "transition_on_drained": sum(1 for r in transition if alog.served_by.get(r) == victim),
        "after_drain_requests": len(after),
        "after_drain_on_drained": leaked,
        "moved_sessions": len(moved),
        "moved_sticky_share": moved_sticky / moved_total if moved_total else math.nan,
        "other_sessions": len(stayed),
        "other_stayed_share": stayed_home / stayed_total if stayed_total else math.nan,
        "sessions_per_home_after": dict(Counter(new_homes.values())),
    }
