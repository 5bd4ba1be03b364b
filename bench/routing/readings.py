"""What ``bench.routing`` reads from its processes (bench/routing/fleet.py starts them).

The CPU counters read around a run (:class:`CpuMark`, by process group, children included;
:func:`cpu_figures`), and the counters read from the workers and the router: prefix-cache
queries and hits, requests received, the engines' queue wait and TTFT (:func:`read_fleet`,
:func:`engine_sums_between`), the policies' decisions and the router's cache checks
(:func:`router_decisions`, :func:`router_cache_checks`), and the reset to cold caches and
zeroed counters before every run (:func:`reset_workers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.routing.fleet import MODEL, Fleet
from harness.procfs import CLK_TCK, cpu_times, machine_ticks

# --------------------------------------------------------------------------- CPU readings


def descendants(roots: list[int]) -> list[int]:
    """The given pids and every process below them (Celery's beat runs as a child)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
        except OSError:
            continue
        ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):  # it exited meanwhile
            total += sum(cpu_times(pid))
    return total


@dataclass(frozen=True)
class CpuMark:
    """CPU counters around a run: the proxy's, this benchmark's by process group (load
    generator, workers, router, floor, celery), the machine's."""

    router: float
    groups: dict[str, float]
    busy: int
    total: int

    @classmethod
    def take(cls, fleet: Fleet, proxy_pid: int) -> CpuMark:
        """`router` is the CPU of `proxy_pid`: the router, or the floor proxy."""
        groups = {"load generator": time.process_time()}
        for child in fleet.proc.procs:
            group = "workers" if child.name.startswith("worker") else child.name
            groups[group] = groups.get(group, 0.0) + cpu_seconds(descendants([child.pid]))
        busy, total = machine_ticks()
        return cls(cpu_seconds([proxy_pid]), groups, busy, total)


def cpu_figures(before: CpuMark, after: CpuMark) -> tuple[float, float, float, dict[str, float]]:
    """(router CPU seconds, machine busy %, busy % of processes not in this benchmark, CPU
    seconds by process group)."""
    ticks = max(after.total - before.total, 1)
    busy_s = (after.busy - before.busy) / CLK_TCK
    groups = {k: v - before.groups.get(k, 0.0) for k, v in after.groups.items()}
    other = 100 * (busy_s - sum(groups.values())) * CLK_TCK / ticks
    busy_pct = 100 * (after.busy - before.busy) / ticks
    return after.router - before.router, busy_pct, max(0.0, other), groups


# --------------------------------------------------------------------------- worker counters


# Sums read from a worker's /metrics page: prefix-cache tokens, and the engine's own
# queue wait and time to first token (sum and count), which split a mode's client-side TTFT
# into the wait for a batch slot (where the routing put it), the engine's prefill (what the
# cache saved) and the hop (what is left: proxy, load generator, the machine's contention).
ENGINE_SUMS = {
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:request_queue_time_seconds_sum": "queue_s",
    "vllm:request_queue_time_seconds_count": "queued",
    "vllm:time_to_first_token_seconds_sum": "engine_ttft_s",
    "vllm:time_to_first_token_seconds_count": "engine_firsts",
}


def engine_sums(text: str) -> dict[str, float]:
    """ENGINE_SUMS' keys -> their sum over the page's samples (0 when absent)."""
    out = dict.fromkeys(ENGINE_SUMS.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = ENGINE_SUMS.get(sample.name)
            if key is not None:
                out[key] += sample.value
    return out


def policy_decisions(text: str) -> dict[tuple[str, str], float]:
    """(policy, decision) -> count for MODEL, from the router's /metrics page."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("controlpanel_router_policy_decisions"):
            continue
        for sample in family.samples:
            if sample.labels.get("model") == MODEL and not sample.name.endswith("_created"):
                key = (sample.labels.get("policy", "?"), sample.labels.get("decision", "?"))
                out[key] = out.get(key, 0.0) + sample.value
    return out


CACHE_CHECK = {  # the router's cache-check samples (routing/telemetry/cache_check.py) -> our keys
    "controlpanel_router_cache_prediction_error_tokens_count": "checked",
    "controlpanel_router_cache_predictions_within_block_total": "within_block",
    "controlpanel_router_cache_predicted_tokens_total": "predicted",
    "controlpanel_router_cache_reported_tokens_total": "reported",
    "controlpanel_router_cache_predictions_unchecked_total": "unchecked",
    "controlpanel_router_kv_aware_fallbacks_total": "fallbacks",
}


CACHE_CHECK_PREFIXES = ("controlpanel_router_cache", "controlpanel_router_kv_aware")


def cache_checks(text: str) -> dict[str, dict[str, float]]:
    """policy -> the router's cache-check counters for MODEL (predictions checked, within one
    block, predicted and reported token sums, unchecked; kv_aware's fallbacks)."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(CACHE_CHECK_PREFIXES):
            continue
        for sample in family.samples:
            key = CACHE_CHECK.get(sample.name)
            if key is None or sample.labels.get("model") != MODEL:
                continue
            policy = sample.labels.get("policy", "kv_aware")
            tally = out.setdefault(policy, {})
            tally[key] = tally.get(key, 0.0) + sample.value
    return out


async def router_cache_checks(
    session: aiohttp.ClientSession, router: str
) -> dict[str, dict[str, float]]:
    async with session.get(router + "/metrics") as resp:
        return cache_checks(await resp.text())


def check_delta(
    after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """after - before, per policy and counter; policies with no change are left out."""
    out = {}
    for policy, tally in after.items():
        old = before.get(policy, {})
        delta = {k: v - old.get(k, 0.0) for k, v in tally.items()}
        if any(delta.values()):
            out[policy] = delta
    return out


@dataclass(frozen=True)
class WorkerReading:
    queries: float
    hits: float
    received: int
    running: int
    waiting: int
    queue_s: float = 0.0
    queued: float = 0.0
    engine_ttft_s: float = 0.0
    engine_firsts: float = 0.0


async def read_worker(session: aiohttp.ClientSession, url: str) -> WorkerReading:
    async with session.get(url + "/metrics") as resp:
        sums = engine_sums(await resp.text())
    async with session.get(url + "/sim/stats") as resp:
        stats = orjson.loads(await resp.read())
    return WorkerReading(
        received=stats["received"], running=stats["running"], waiting=stats["waiting"], **sums
    )


Sums = tuple[float, float]  # (seconds summed, requests counted)


def engine_sums_between(
    after: list[WorkerReading], before: list[WorkerReading]
) -> tuple[Sums, Sums]:
    """Over the requests between two readings of the fleet: the engines' queue wait and
    their TTFT, each as (seconds summed, requests)."""
    pairs = list(zip(after, before, strict=True))
    queue = (
        sum(a.queue_s - b.queue_s for a, b in pairs),
        sum(a.queued - b.queued for a, b in pairs),
    )
    ttft = (
        sum(a.engine_ttft_s - b.engine_ttft_s for a, b in pairs),
        sum(a.engine_firsts - b.engine_firsts for a, b in pairs),
    )
    return queue, ttft


def mean_ms(sums: Sums) -> float:
    seconds, n = sums
    return 1000 * seconds / n if n else math.nan


def engine_means_ms(after: list[WorkerReading], before: list[WorkerReading]) -> tuple[float, float]:
    """(mean queue wait, mean engine TTFT) in ms over the requests between two readings."""
    queue, ttft = engine_sums_between(after, before)
    return mean_ms(queue), mean_ms(ttft)


async def read_fleet(session: aiohttp.ClientSession, fleet: Fleet) -> list[WorkerReading]:
    return list(await asyncio.gather(*(read_worker(session, u) for u in fleet.workers)))


async def reset_workers(session: aiohttp.ClientSession, fleet: Fleet) -> None:
    """Cold caches and zeroed counters on every worker; waits until nothing is running."""
    deadline = time.monotonic() + 30
    while True:
        readings = await read_fleet(session, fleet)
        if all(r.running == 0 and r.waiting == 0 for r in readings):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("workers still busy 30 s after a run")
        await asyncio.sleep(0.1)
    for url in fleet.workers:
        async with session.post(url + "/sim/reset") as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"POST {url}/sim/reset: HTTP {resp.status}")


async def router_decisions(
    session: aiohttp.ClientSession, fleet: Fleet
) -> dict[tuple[str, str], float]:
    async with session.get(fleet.router + "/metrics") as resp:
        return policy_decisions(await resp.text())
