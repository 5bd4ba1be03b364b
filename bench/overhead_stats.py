"""The figures of ``bench/overhead.py``: one round's, and each scenario's medians over rounds.

A library for that script, not a script: :class:`RoundStats` and :func:`round_stats` turn one
round's samples and the CPU counters around it into throughput, latency, TTFT and CPU per
request (router, floor, baseline, load generator) and the share of the machine other processes
kept busy; :func:`summarize` and :func:`baseline_summary` take the medians over rounds and the
"added" and "minus floor" differences the report shows; :func:`idle_cpu_ms_per_s` is a proxy's
background CPU, from the rounds where it serves nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from bench.harness import CLK_TCK, percentile
from bench.overhead_load import (
    BASELINE,
    STREAM_ITL_MS,
    STREAM_TOKENS,
    STREAM_TTFT_MS,
    CpuSample,
    Samples,
    Scenario,
)


@dataclass
class RoundStats:
    mode: str
    requests: int
    ok: int
    errors: int
    wall_s: float
    rps: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    router_cpu_ms: float
    router_cpu_ms_per_req: float
    router_user_ms_per_req: float
    router_sys_ms_per_req: float
    floor_cpu_ms: float
    floor_cpu_ms_per_req: float
    floor_user_ms_per_req: float
    floor_sys_ms_per_req: float
    client_cpu_ms_per_req: float
    machine_busy_pct: float
    other_busy_pct: float
    # Only with --baseline-tree (left out of the JSON otherwise).
    baseline_cpu_ms: float | None = None
    baseline_cpu_ms_per_req: float | None = None
    baseline_user_ms_per_req: float | None = None
    baseline_sys_ms_per_req: float | None = None

    def record(self) -> dict[str, Any]:
        """The round for the JSON: every figure, the baseline's only when it ran."""
        return {
            k: v for k, v in asdict(self).items() if v is not None or not k.startswith(BASELINE)
        }


def round_stats(
    mode: str,
    samples: Samples,
    wall: float,
    before: CpuSample,
    after: CpuSample,
    baseline: bool = False,
) -> RoundStats:
    lat = [x * 1000 for x in samples.latencies]
    ttft = [x * 1000 for x in samples.ttfts]
    n = len(lat) + samples.errors
    user = after.router_user - before.router_user
    system = after.router_sys - before.router_sys
    floor_user = after.floor_user - before.floor_user
    floor_sys = after.floor_sys - before.floor_sys
    per_req = 1000 / max(n, 1)
    return RoundStats(
        mode=mode,
        requests=n,
        ok=len(lat),
        errors=samples.errors,
        wall_s=wall,
        rps=len(lat) / wall,
        p50_ms=percentile(lat, 50),
        p99_ms=percentile(lat, 99),
        mean_ms=statistics.fmean(lat) if lat else float("nan"),
        max_ms=max(lat, default=float("nan")),
        ttft_p50_ms=percentile(ttft, 50) if ttft else None,
        ttft_p99_ms=percentile(ttft, 99) if ttft else None,
        router_cpu_ms=(user + system) * 1000,
        router_cpu_ms_per_req=(user + system) * per_req,
        router_user_ms_per_req=user * per_req,
        router_sys_ms_per_req=system * per_req,
        floor_cpu_ms=(floor_user + floor_sys) * 1000,
        floor_cpu_ms_per_req=(floor_user + floor_sys) * per_req,
        floor_user_ms_per_req=floor_user * per_req,
        floor_sys_ms_per_req=floor_sys * per_req,
        client_cpu_ms_per_req=(after.client - before.client) * per_req,
        machine_busy_pct=100 * (after.busy - before.busy) / max(after.total - before.total, 1),
        other_busy_pct=other_busy_pct(before, after),
        **(baseline_cpu(before, after, per_req) if baseline else {}),
    )


def baseline_cpu(before: CpuSample, after: CpuSample, per_req: float) -> dict[str, float]:
    """The baseline router's CPU in one round: total ms, and ms per request of the round."""
    user = after.baseline_user - before.baseline_user
    system = after.baseline_sys - before.baseline_sys
    return {
        "baseline_cpu_ms": (user + system) * 1000,
        "baseline_cpu_ms_per_req": (user + system) * per_req,
        "baseline_user_ms_per_req": user * per_req,
        "baseline_sys_ms_per_req": system * per_req,
    }


def other_busy_pct(before: CpuSample, after: CpuSample) -> float:
    """Share of all CPUs busy with processes other than this benchmark's (0 on a quiet box)."""
    busy = (after.busy - before.busy) / CLK_TCK
    ours = after.ours() - before.ours()
    return max(0.0, 100 * (busy - ours) * CLK_TCK / max(after.total - before.total, 1))


def med(rounds: list[RoundStats], attr: str) -> float:
    values = [getattr(r, attr) for r in rounds]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def idle_cpu_ms_per_s(rounds: list[RoundStats], proxy: str) -> float:
    """CPU of `proxy` ("router", "floor" or "baseline") per second of the rounds where it
    serves nothing
    (for the router: snapshot refresher, in-flight reports)."""
    idle = [r for r in rounds if r.mode != proxy]
    wall = sum(r.wall_s for r in idle)
    cpu = sum(getattr(r, f"{proxy}_cpu_ms") for r in idle)
    return cpu / wall if wall else float("nan")


def summarize(sc: Scenario, results: dict[str, list[RoundStats]]) -> dict[str, Any]:
    direct, floor, router = results["direct"], results["floor"], results["router"]
    d_rps, f_rps, r_rps = med(direct, "rps"), med(floor, "rps"), med(router, "rps")
    every = [r for rounds in results.values() for r in rounds]
    summary: dict[str, Any] = {
        "scenario": sc.name,
        "concurrency": sc.concurrency,
        "requests_per_round": sc.requests,
        "rounds": len(router),
        "direct_rps": d_rps,
        "router_rps": r_rps,
        "ratio": r_rps / d_rps,
        "direct_p50_ms": med(direct, "p50_ms"),
        "router_p50_ms": med(router, "p50_ms"),
        "direct_p99_ms": med(direct, "p99_ms"),
        "router_p99_ms": med(router, "p99_ms"),
        "router_cpu_ms_per_req": med(router, "router_cpu_ms_per_req"),
        "router_user_ms_per_req": med(router, "router_user_ms_per_req"),
        "router_sys_ms_per_req": med(router, "router_sys_ms_per_req"),
        "floor_rps": f_rps,
        "floor_ratio": f_rps / d_rps,
        "router_floor_ratio": r_rps / f_rps,
        "floor_p50_ms": med(floor, "p50_ms"),
        "floor_p99_ms": med(floor, "p99_ms"),
        "floor_cpu_ms_per_req": med(floor, "floor_cpu_ms_per_req"),
        "floor_user_ms_per_req": med(floor, "floor_user_ms_per_req"),
        "floor_sys_ms_per_req": med(floor, "floor_sys_ms_per_req"),
        "machine_busy_pct_direct": med(direct, "machine_busy_pct"),
        "machine_busy_pct_floor": med(floor, "machine_busy_pct"),
        "machine_busy_pct_router": med(router, "machine_busy_pct"),
        "other_busy_pct": med(every, "other_busy_pct"),
        "router_idle_cpu_ms_per_s": idle_cpu_ms_per_s(every, "router"),
        "floor_idle_cpu_ms_per_s": idle_cpu_ms_per_s(every, "floor"),
        "client_cpu_ms_per_req_direct": med(direct, "client_cpu_ms_per_req"),
        "client_cpu_ms_per_req_floor": med(floor, "client_cpu_ms_per_req"),
        "client_cpu_ms_per_req_router": med(router, "client_cpu_ms_per_req"),
        "errors": sum(r.errors for r in every),
    }
    summary["added_p50_ms"] = summary["router_p50_ms"] - summary["direct_p50_ms"]
    summary["added_p99_ms"] = summary["router_p99_ms"] - summary["direct_p99_ms"]
    summary["floor_added_p50_ms"] = summary["floor_p50_ms"] - summary["direct_p50_ms"]
    summary["floor_added_p99_ms"] = summary["floor_p99_ms"] - summary["direct_p99_ms"]
    summary["router_minus_floor_p50_ms"] = summary["router_p50_ms"] - summary["floor_p50_ms"]
    summary["router_minus_floor_cpu_ms_per_req"] = (
        summary["router_cpu_ms_per_req"] - summary["floor_cpu_ms_per_req"]
    )
    if sc.stream:
        summary["direct_ttft_p50_ms"] = med(direct, "ttft_p50_ms")
        summary["floor_ttft_p50_ms"] = med(floor, "ttft_p50_ms")
        summary["router_ttft_p50_ms"] = med(router, "ttft_p50_ms")
        summary["added_ttft_p50_ms"] = summary["router_ttft_p50_ms"] - summary["direct_ttft_p50_ms"]
        summary["floor_added_ttft_p50_ms"] = (
            summary["floor_ttft_p50_ms"] - summary["direct_ttft_p50_ms"]
        )
        one_stream_s = (STREAM_TTFT_MS + (STREAM_TOKENS - 1) * STREAM_ITL_MS) / 1000
        summary["nominal_rps"] = sc.concurrency / one_stream_s
    if BASELINE in results:
        summary.update(baseline_summary(sc, results[BASELINE], summary, every))
    return summary


def baseline_summary(
    sc: Scenario, rounds: list[RoundStats], summary: dict[str, Any], every: list[RoundStats]
) -> dict[str, Any]:
    """The baseline router's medians, next to the router's and the floor's in `summary`."""
    b: dict[str, Any] = {
        "baseline_rps": med(rounds, "rps"),
        "baseline_p50_ms": med(rounds, "p50_ms"),
        "baseline_p99_ms": med(rounds, "p99_ms"),
        "baseline_cpu_ms_per_req": med(rounds, "baseline_cpu_ms_per_req"),
        "baseline_user_ms_per_req": med(rounds, "baseline_user_ms_per_req"),
        "baseline_sys_ms_per_req": med(rounds, "baseline_sys_ms_per_req"),
        "machine_busy_pct_baseline": med(rounds, "machine_busy_pct"),
        "client_cpu_ms_per_req_baseline": med(rounds, "client_cpu_ms_per_req"),
        "baseline_idle_cpu_ms_per_s": idle_cpu_ms_per_s(every, BASELINE),
    }
    b["baseline_ratio"] = b["baseline_rps"] / summary["direct_rps"]
    b["router_baseline_ratio"] = summary["router_rps"] / b["baseline_rps"]
    b["baseline_added_p50_ms"] = b["baseline_p50_ms"] - summary["direct_p50_ms"]
    cpu = b["baseline_cpu_ms_per_req"]
    b["baseline_minus_floor_cpu_ms_per_req"] = cpu - summary["floor_cpu_ms_per_req"]
    b["router_minus_baseline_cpu_ms_per_req"] = summary["router_cpu_ms_per_req"] - cpu
    if sc.stream:
        b["baseline_ttft_p50_ms"] = med(rounds, "ttft_p50_ms")
        b["baseline_added_ttft_p50_ms"] = b["baseline_ttft_p50_ms"] - summary["direct_ttft_p50_ms"]
    return b
