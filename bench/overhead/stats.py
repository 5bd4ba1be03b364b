"""The figures of ``bench.overhead``: one round's, and each scenario's medians over rounds.

A library for that script, not a script: :class:`RoundStats` and :func:`round_stats` turn one
round's samples and the CPU counters around it into throughput, latency, TTFT, the CPU of every
proxy in the round (the measured one's per request, user and system apart) and of the load
generator, and the share of the machine other processes kept busy; :func:`summarize` takes the
medians over rounds per mode and the differences the report shows ("added" = the mode minus
direct, "minus floor" = its CPU per request minus the floor's, the ratio to direct's
throughput), under keys named after the mode (:func:`bench.overhead.load.key`; the router's
also under the names of the first version); :func:`idle_cpu_ms_per_s` is a proxy's background
CPU, from the rounds where it serves nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from bench.common.output import percentile
from bench.overhead.load import (
    STREAM_ITL_MS,
    STREAM_TOKENS,
    STREAM_TTFT_MS,
    CpuSample,
    Samples,
    Scenario,
    key,
)
from harness.procfs import CLK_TCK


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
    cpu_ms: dict[str, float]  # every proxy's CPU in this round (served or idle), ms
    cpu_ms_per_req: float | None  # the measured proxy's (None in direct rounds)
    user_ms_per_req: float | None
    sys_ms_per_req: float | None
    client_cpu_ms_per_req: float
    machine_busy_pct: float
    other_busy_pct: float

    def record(self) -> dict[str, Any]:
        """The round for the JSON."""
        return asdict(self)


def round_stats(
    mode: str, samples: Samples, wall: float, before: CpuSample, after: CpuSample
) -> RoundStats:
    lat = [x * 1000 for x in samples.latencies]
    ttft = [x * 1000 for x in samples.ttfts]
    n = len(lat) + samples.errors
    per_req = 1000 / max(n, 1)
    used = {
        m: (after.proxies[m][0] - u, after.proxies[m][1] - s)
        for m, (u, s) in before.proxies.items()
    }
    user, system = used.get(mode, (None, None))
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
        cpu_ms={m: (u + s) * 1000 for m, (u, s) in used.items()},
        cpu_ms_per_req=None if user is None or system is None else (user + system) * per_req,
        user_ms_per_req=None if user is None else user * per_req,
        sys_ms_per_req=None if system is None else system * per_req,
        client_cpu_ms_per_req=(after.client - before.client) * per_req,
        machine_busy_pct=100 * (after.busy - before.busy) / max(after.total - before.total, 1),
        other_busy_pct=other_busy_pct(before, after),
    )


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
    """CPU of the proxy mode `proxy` per second of the rounds where it serves nothing (for the
    router: snapshot refresher, in-flight reports)."""
    idle = [r for r in rounds if r.mode != proxy and proxy in r.cpu_ms]
    wall = sum(r.wall_s for r in idle)
    return sum(r.cpu_ms[proxy] for r in idle) / wall if wall else float("nan")


def mode_summary(
    sc: Scenario, mode: str, rounds: list[RoundStats], s: dict[str, Any], every: list[RoundStats]
) -> dict[str, Any]:
    """One mode's medians, and its differences to direct and the floor already in `s`."""
    k = key(mode)
    m: dict[str, Any] = {
        f"{k}_rps": med(rounds, "rps"),
        f"{k}_p50_ms": med(rounds, "p50_ms"),
        f"{k}_p99_ms": med(rounds, "p99_ms"),
        f"{k}_errors": sum(r.errors for r in rounds),
        f"machine_busy_pct_{k}": med(rounds, "machine_busy_pct"),
        f"client_cpu_ms_per_req_{k}": med(rounds, "client_cpu_ms_per_req"),
    }
    if sc.stream:
        m[f"{k}_ttft_p50_ms"] = med(rounds, "ttft_p50_ms")
    if mode == "direct":
        return m
    m[f"{k}_ratio"] = m[f"{k}_rps"] / s["direct_rps"]
    m[f"{k}_added_p50_ms"] = m[f"{k}_p50_ms"] - s["direct_p50_ms"]
    m[f"{k}_added_p99_ms"] = m[f"{k}_p99_ms"] - s["direct_p99_ms"]
    if sc.stream:
        m[f"{k}_added_ttft_p50_ms"] = m[f"{k}_ttft_p50_ms"] - s["direct_ttft_p50_ms"]
    for what in ("cpu", "user", "sys"):
        m[f"{k}_{what}_ms_per_req"] = med(rounds, f"{what}_ms_per_req")
    m[f"{k}_idle_cpu_ms_per_s"] = idle_cpu_ms_per_s(every, mode)
    if mode != "floor" and "floor_cpu_ms_per_req" in s:
        floor = s["floor_cpu_ms_per_req"]
        m[f"{k}_minus_floor_cpu_ms_per_req"] = m[f"{k}_cpu_ms_per_req"] - floor
        m[f"{k}_floor_ratio"] = m[f"{k}_rps"] / s["floor_rps"]
    return m


def summarize(sc: Scenario, results: dict[str, list[RoundStats]]) -> dict[str, Any]:
    """Medians per mode (direct first, then the floor, then the others)."""
    every = [r for rounds in results.values() for r in rounds]
    s: dict[str, Any] = {
        "scenario": sc.name,
        "concurrency": sc.concurrency,
        "requests_per_round": sc.requests,
        "stream": sc.stream,
        "rounds": len(results["direct"]),
        "modes": list(results),
        "other_busy_pct": med(every, "other_busy_pct"),
        "errors": sum(r.errors for r in every),
    }
    for mode in sorted(results, key=lambda mode: (mode != "direct", mode != "floor")):
        s.update(mode_summary(sc, mode, results[mode], s, every))
    # The router's figures under their first names, as RESULTS.md quotes them.
    s["ratio"] = s["router_ratio"]
    s["added_p50_ms"] = s["router_added_p50_ms"]
    s["added_p99_ms"] = s["router_added_p99_ms"]
    if sc.stream:
        s["added_ttft_p50_ms"] = s["router_added_ttft_p50_ms"]
        one_stream_s = (STREAM_TTFT_MS + (STREAM_TOKENS - 1) * STREAM_ITL_MS) / 1000
        s["nominal_rps"] = sc.concurrency / one_stream_s
    return s
