"""What ``bench.replicas`` sends and reads: its workloads, one measured run, its counters.

A library for that script, not a script:

* **Workloads** (:data:`WORKLOADS`): ``prefix`` and ``skewed`` are the routing benchmark's
  seeded chat sessions (``bench/routing/workloads.py``), sent by its load generator
  (``bench/routing/load.py``: streamed, ``max_tokens`` 16, 32 in flight); ``stream`` is
  ``bench.overhead``'s 64-token streams (closed loop, 32 clients) and ``tiny`` its
  non-streamed one-token requests (closed loop, 64 clients), the throughput scenario, both
  from ``bench/overhead/load.py``. The client oracle is the routing benchmark's (group g
  to worker g mod 4); for ``stream`` and ``tiny``, which have no prefixes, the client spreads
  its requests round robin over the workers.
* **CPU of every process** (:class:`CpuMark`): each router process (and what it started), haproxy,
  Celery (beat included), each worker and this load generator from ``/proc/<pid>/stat``, and,
  read the same way, the PostgreSQL and Redis servers' processes (found by name; shared
  servers, so other clients' work counts too); the rest of the machine's busy time is "other".
* **Shared state** (:func:`redis_memory`, :func:`shared_bytes`): Redis's ``used_memory``
  (server-wide) and the bytes of the keys in the run's own db (``MEMORY USAGE``, also by key
  prefix: Celery's broker, the channel layer's groups and queues, the cache), before and after
  every run; and the routers' own counter of bytes they publish to the shared state,
  when a build has one (:data:`SHARED_BYTES_METRIC` on ``/metrics``), else ``None``.
* :func:`run_one` is one run from cold caches: reset the workers, read every counter, send the
  workload, read them again (:class:`Run`).
"""

from __future__ import annotations

import contextlib
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from prometheus_client.parser import text_string_to_metric_families

from bench.common.output import percentile
from bench.overhead.load import Scenario, load_round
from bench.replicas.setups import FLOORS, ORACLE, ROUTERLESS, ROUTERS2, Setup
from bench.routing import fleet as rf
from bench.routing import readings as rd
from bench.routing.load import CONCURRENCY, pickers, run_sessions
from bench.routing.workloads import Workload
from harness.fleet import Fleet
from harness.procfs import CLK_TCK, machine_ticks

WORKLOADS = ("prefix", "skewed", "stream", "tiny")
STREAM_CONCURRENCY = 32
TINY_CONCURRENCY = 64
STREAM_REQUESTS = {"full": 640, "quick": 160}
TINY_REQUESTS = {"full": 3000, "quick": 600}
# The hook for shared routing state: a counter of the bytes a router publishes to it. Summed over
# every router process this benchmark can address; absent in builds without shared state.
SHARED_BYTES_METRIC = "controlpanel_router_shared_bytes"
# "asgispecific.<id>!" (a channel's queue), "asgi:group:...", "_kombu.binding...", ":1:..."
KEY_PREFIX = re.compile(r":?[^:.!]+")
SERVICES = {"postgres": "postgres", "redis-server": "redis"}  # /proc/<pid>/comm -> group


# --------------------------------------------------------------------------- CPU


def service_pids() -> dict[int, str]:
    """pid -> "postgres" or "redis" for the database and Redis servers' processes."""
    out: dict[int, str] = {}
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            group = SERVICES.get(comm.read_text().strip())
            if group:
                out[int(comm.parent.name)] = group
    return out


@dataclass(frozen=True)
class CpuMark:
    """CPU seconds by process (label -> s), by service pid, and the machine's ticks."""

    procs: dict[str, float]
    services: dict[int, tuple[str, float]]
    busy: int
    total: int

    @classmethod
    def take(cls, proc: Fleet) -> CpuMark:
        procs = {"load generator": time.process_time()}
        for child in proc.procs:
            name, pids = child.name, rd.descendants([child.pid])
            procs[name] = rd.cpu_seconds(pids[:1])
            # serve's routers, Celery's beat, ...: numbered in pid order, not by pid, so the
            # same child of every round's new `serve` has one label and one median.
            for i, pid in enumerate(sorted(pids[1:]), 1):
                procs[f"{name}/{i}"] = rd.cpu_seconds([pid])
        services = {}
        for pid, group in service_pids().items():
            services[pid] = (group, rd.cpu_seconds([pid]))
        busy, total = machine_ticks()
        return cls(procs, services, busy, total)


def cpu_delta(before: CpuMark, after: CpuMark) -> tuple[dict[str, float], float, float]:
    """(CPU seconds by process and service, machine busy %, other processes' busy %)."""
    out = {k: v - before.procs.get(k, 0.0) for k, v in after.procs.items()}
    for pid, (group, seconds) in after.services.items():
        was = before.services.get(pid, (group, 0.0))[1]  # a backend that started meanwhile: 0
        out[group] = out.get(group, 0.0) + seconds - was
    ticks = max(after.total - before.total, 1)
    busy_pct = 100 * (after.busy - before.busy) / ticks
    ours_pct = 100 * sum(out.values()) * CLK_TCK / ticks
    return out, busy_pct, max(0.0, busy_pct - ours_pct)


# --------------------------------------------------------------------------- shared state


def redis_memory(url: str) -> dict[str, Any]:
    """Redis's used_memory (whole server), and the keys of this run's db and their bytes
    (``MEMORY USAGE``), in all and by key prefix (up to the first ":")."""
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        used = int(client.info("memory")["used_memory"])
        by_prefix: dict[str, int] = {}
        keys = 0
        for key in client.scan_iter(count=500):
            keys += 1
            match = KEY_PREFIX.match(key.decode(errors="replace"))
            prefix = match.group(0) if match else "?"
            size = int(client.memory_usage(key) or 0)
            by_prefix[prefix] = by_prefix.get(prefix, 0) + size
        return {
            "used_memory": used,
            "db_keys": keys,
            "db_bytes": sum(by_prefix.values()),
            "db_bytes_by_prefix": by_prefix,
        }
    finally:
        client.close()


async def shared_bytes(http: aiohttp.ClientSession, setup: Setup) -> float | None:
    """Sum of SHARED_BYTES_METRIC over the set-up's routers; None when no router has it, and
    for `serve --routers N`, whose processes share one port: a scrape reaches one of them at
    random, so their counters cannot be summed from outside."""
    if setup.name == ROUTERS2:
        return None
    total, seen = 0.0, False
    for url in setup.router_urls:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(SHARED_BYTES_METRIC):
                continue
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    total += sample.value
                    seen = True
    return total if seen else None


# --------------------------------------------------------------------------- one run


@dataclass
class Run:
    """One workload on one set-up in one round."""

    setup: str
    workload: str
    policy: str
    round: int
    requests: int
    ok: int
    errors: int
    error_kinds: dict[str, int]
    wall_s: float
    rps: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    hit_rate: float
    per_worker: list[int]
    spread: float  # busiest worker's requests / the mean
    cpu_s: dict[str, float]  # by process (and postgres, redis)
    router_cpu_s: float
    router_cpu_ms_per_req: float
    haproxy_cpu_ms_per_req: float | None
    machine_busy_pct: float
    other_busy_pct: float
    redis_before: dict[str, int]
    redis_after: dict[str, int]
    shared_bytes: float | None  # published during the run, when the routers count it
    shared_bytes_per_s: float | None
    notes: list[str] = field(default_factory=list)
    # The routers' cache check of the policy, summed over them (--kv): within one block /
    # checked, and the number checked.
    accuracy: float = math.nan
    checked: float = 0.0
    # Engine-side means over the run's requests (bench.routing.readings.ENGINE_SUMS): the wait
    # for a batch slot, and wait + prefill. The client's TTFT minus the engine's is the hop.
    queue_wait_ms: float = math.nan
    engine_ttft_ms: float = math.nan
    decisions: dict[str, float] = field(default_factory=dict)  # the policy's, by kind


@dataclass(frozen=True)
class Sent:
    ttfts: list[float]  # seconds
    latencies: list[float]
    requests: int
    errors: int
    error_kinds: dict[str, int]
    wall_s: float


async def send(
    workload: str,
    setup: Setup,
    workers: rf.Fleet,
    chats: dict[str, Workload],
    scale: str,
    tag: str,
) -> Sent:
    """The workload's traffic to the set-up's front, or to the workers for the oracle."""
    if workload in chats:
        front: Callable[[Any], str] = lambda s: setup.front  # noqa: E731
        pick = pickers(workers)["client_oracle"] if setup.name in ROUTERLESS else front
        if setup.name in FLOORS:  # the oracle's worker, named to the floor proxy
            oracle = pick
            pick = lambda s: pinned(setup, workers, oracle(s))  # noqa: E731
        samples, wall = await run_sessions(
            chats[workload], pick, CONCURRENCY, tag, include_usage=bool(workers.kv_events)
        )
        kinds = dict(samples.error_kinds)
        return Sent(samples.ttfts, samples.latencies, samples.sent, samples.errors, kinds, wall)
    stream = workload == "stream"
    n = (STREAM_REQUESTS if stream else TINY_REQUESTS)[scale]
    sc = Scenario(workload, rf.MODEL, STREAM_CONCURRENCY if stream else TINY_CONCURRENCY, n, stream)
    urls = workers.workers if setup.name == ORACLE else [setup.front]
    if setup.name in FLOORS:  # round robin, as the oracle's
        urls = [pinned(setup, workers, url) for url in workers.workers]
    out, wall = await load_round([u + "/v1/chat/completions" for u in urls], sc, n)
    kinds = {"failed": out.errors} if out.errors else {}
    return Sent(out.ttfts, out.latencies, n, out.errors, kinds, wall)


def pinned(setup: Setup, workers: rf.Fleet, worker: str) -> str:
    """The floor proxy's address for `worker` (bench/common/floor_proxy.py's /upstream/<i>/)."""
    return f"{setup.front}/upstream/{workers.workers.index(worker)}"


async def run_one(
    http: aiohttp.ClientSession,
    proc: Fleet,
    setup: Setup,
    workers: rf.Fleet,
    chats: dict[str, Workload],
    spec: tuple[str, str, int, str],
    redis_url: str,
) -> Run:
    """One run from cold caches; `spec` is (workload, policy, round, scale)."""
    workload, policy, rnd, scale = spec
    await rd.reset_workers(http, workers)
    proc.check_alive()
    rf.revive_celery(workers)
    redis_before = redis_memory(redis_url)
    shared_before = await shared_bytes(http, setup)
    fleet_before = await rd.read_fleet(http, workers)
    checks_before = await cache_checks(http, setup, policy)
    decided_before = await policy_decisions(http, setup, policy)
    cpu_before = CpuMark.take(proc)
    sent = await send(workload, setup, workers, chats, scale, f"{setup.name}-{workload}-{rnd}")
    cpu_after = CpuMark.take(proc)
    fleet_after = await rd.read_fleet(http, workers)
    checks_after = await cache_checks(http, setup, policy)
    decided_after = await policy_decisions(http, setup, policy)
    checked = checks_after.get("checked", 0.0) - checks_before.get("checked", 0.0)
    within = checks_after.get("within_block", 0.0) - checks_before.get("within_block", 0.0)
    shared_after = await shared_bytes(http, setup)
    redis_after = redis_memory(redis_url)
    cpu, busy, other = cpu_delta(cpu_before, cpu_after)
    pairs = list(zip(fleet_after, fleet_before, strict=True))
    queue_ms, engine_ms = rd.engine_means_ms(fleet_after, fleet_before)
    queries = sum(a.queries - b.queries for a, b in pairs)
    hits = sum(a.hits - b.hits for a, b in pairs)
    per_worker = [a.received - b.received for a, b in pairs]
    router_cpu = sum(v for k, v in cpu.items() if k.split("/", 1)[0] in setup.routers)
    haproxy_cpu = sum(v for k, v in cpu.items() if k.endswith("haproxy"))
    n = max(sent.requests, 1)
    ttft = [x * 1000 for x in sent.ttfts]
    lat = [x * 1000 for x in sent.latencies]
    published = (
        shared_after - shared_before
        if shared_after is not None and shared_before is not None
        else None
    )
    return Run(
        setup=setup.name,
        workload=workload,
        policy=policy,
        round=rnd,
        requests=sent.requests,
        ok=len(lat),
        errors=sent.errors,
        error_kinds=sent.error_kinds,
        wall_s=sent.wall_s,
        rps=len(lat) / sent.wall_s if sent.wall_s else math.nan,
        ttft_mean_ms=statistics.fmean(ttft) if ttft else math.nan,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        latency_p50_ms=percentile(lat, 50),
        latency_p99_ms=percentile(lat, 99),
        hit_rate=hits / queries if queries else math.nan,
        per_worker=per_worker,
        spread=max(per_worker) / max(statistics.fmean(per_worker), 1e-9),
        cpu_s=cpu,
        router_cpu_s=router_cpu,
        router_cpu_ms_per_req=1000 * router_cpu / n,
        haproxy_cpu_ms_per_req=1000 * haproxy_cpu / n if setup.haproxy_pid else None,
        machine_busy_pct=busy,
        other_busy_pct=other,
        redis_before=redis_before,
        redis_after=redis_after,
        shared_bytes=published,
        shared_bytes_per_s=published / sent.wall_s if published is not None else None,
        accuracy=within / checked if checked else math.nan,
        queue_wait_ms=queue_ms,
        decisions=decision_delta(decided_after, decided_before),
        engine_ttft_ms=engine_ms,
        checked=checked,
    )


async def policy_decisions(
    http: aiohttp.ClientSession, setup: Setup, policy: str
) -> dict[str, float]:
    """`policy`'s decisions by kind, summed over the set-up's routers (one port: only the
    process that answered the scrape)."""
    total: dict[str, float] = {}
    for url in setup.router_urls:
        async with http.get(url + "/metrics") as resp:
            tally = rd.policy_decisions(await resp.text())
        for (name, decision), value in tally.items():
            if name == policy:
                total[decision] = total.get(decision, 0.0) + value
    return total


def decision_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}


async def cache_checks(http: aiohttp.ClientSession, setup: Setup, policy: str) -> dict[str, float]:
    """`policy`'s cache-check counters summed over the set-up's routers (none: the oracle)."""
    total: dict[str, float] = {}
    for url in setup.router_urls:
        tally = (await rd.router_cache_checks(http, url)).get(policy, {})
        for key, value in tally.items():
            total[key] = total.get(key, 0.0) + value
    return total
