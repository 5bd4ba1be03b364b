"""``bench.pd``'s figures: one run's per class (TTFT and inter-token gaps, p50 and p99, from
the requests sent after the warm-up; throughput over the measured window), the medians over
rounds, and the markdown."""

from __future__ import annotations

import statistics
from typing import Any

from bench.common.output import percentile
from bench.pd.workload import Sample

CLASSES = ("chat", "long")


def run_figures(samples: list[Sample], start: float, stop: float, warmup: float) -> dict[str, Any]:
    """Figures of one run; the window is [start + warmup, stop]."""
    begin = start + warmup
    window = stop - begin
    out: dict[str, Any] = {"window_s": window, "errors": sum(1 for s in samples if s.error)}
    kinds: dict[str, int] = {}
    for s in samples:
        if s.error:
            kinds[s.error] = kinds.get(s.error, 0) + 1
    out["error_kinds"] = kinds
    done_tokens = done_requests = 0
    for cls in CLASSES:
        mine = [s for s in samples if s.cls == cls]
        measured = [s for s in mine if s.ok and s.sent >= begin]
        ttfts = [1000 * s.ttft for s in measured if s.ttft is not None]
        gaps = [1000 * g for s in measured for g in s.gaps()]
        tokens = sum(1 for s in mine for t in s.chunks if begin <= t <= stop)
        finished = sum(1 for s in mine if s.ok and begin <= s.chunks[-1] <= stop)
        done_tokens += tokens
        done_requests += finished
        out[cls] = {
            "requests": len(measured),
            "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p99_ms": percentile(ttfts, 99),
            "itl_p50_ms": percentile(gaps, 50),
            "itl_p99_ms": percentile(gaps, 99),
            "gaps": len(gaps),
            "req_s": finished / window,
            "tok_s": tokens / window,
        }
    out["req_s"] = done_requests / window
    out["tok_s"] = done_tokens / window
    return out


FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "req_s", "tok_s")


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per case: the median of every figure over its rounds."""
    out: dict[str, dict[str, Any]] = {}
    for case in dict.fromkeys(r["case"] for r in runs):
        mine = [r for r in runs if r["case"] == case]
        m: dict[str, Any] = {"rounds": len(mine), "errors": sum(r["errors"] for r in mine)}
        for cls in CLASSES:
            m[cls] = {f: statistics.median(r[cls][f] for r in mine) for f in FIGURES}
        m["req_s"] = statistics.median(r["req_s"] for r in mine)
        m["tok_s"] = statistics.median(r["tok_s"] for r in mine)
        m["busy_pct"] = statistics.median(r["machine_busy_pct"] for r in mine)
        out[case] = m
    return out


def ratio(runs: list[dict[str, Any]], case: str, base: str, cls: str, figure: str) -> float:
    """The median over rounds of case / base, each round's own pair."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["case"]] = r[cls][figure]
    pairs = [v[case] / v[base] for v in by_round.values() if case in v and base in v and v[base]]
    return statistics.median(pairs) if pairs else float("nan")


def markdown(result: dict[str, Any]) -> str:
    m, runs, setup = result["medians"], result["runs"], result["setup"]
    machine = result["machine"]
    lines = [
        f"`bench.pd` ({'quick' if result['quick'] else 'full'}; {result['rounds']} round(s) of "
        f"{setup['duration_s']:.0f} s per case, {setup['warmup_s']:.0f} s warm-up; "
        f"{result['wall_s']:.0f} s in all), {machine['nproc']} cores ({machine['cpu_model']}), "
        f"load average {result['loadavg_before'][0]:.2f} before, machine busy "
        f"{statistics.median(r['machine_busy_pct'] for r in runs):.0f} % during the runs "
        "(median; the benchmark's own processes included).",
        "",
        f"Workers: 4 simulated per set-up, `--ttft-ms {setup['ttft_ms']:g} --prefill-ms-per-block "
        f"{setup['prefill_ms_per_block']:g} --itl-ms {setup['itl_ms']:g} "
        f"--prefill-interference-ms-per-block {setup['interference_ms_per_block']:g} "
        f"--kv-transfer-ms-per-block {setup['kv_transfer_ms_per_block']:g}`; load: "
        f"{setup['chat_clients']} chat sessions (30-120-word prompts, 64-128 tokens) and "
        f"{setup['long_clients']} long-prompt clients (3,000-6,000 words, 32 tokens), closed "
        "loop, streamed. Medians over rounds; ms.",
        "",
        "| set-up | chat TTFT p50 / p99 | chat ITL p50 / p99 | long TTFT p50 / p99 "
        "| long ITL p50 / p99 | req/s | output tok/s | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, v in m.items():
        c, g = v["chat"], v["long"]
        lines.append(
            f"| {case} | {c['ttft_p50_ms']:.0f} / {c['ttft_p99_ms']:.0f} "
            f"| {c['itl_p50_ms']:.1f} / {c['itl_p99_ms']:.1f} "
            f"| {g['ttft_p50_ms']:.0f} / {g['ttft_p99_ms']:.0f} "
            f"| {g['itl_p50_ms']:.1f} / {g['itl_p99_ms']:.1f} "
            f"| {v['req_s']:.1f} | {v['tok_s']:.0f} | {v['errors']} |"
        )
    lines.append("")
    base = "colocated"
    if base in m:
        for case in m:
            if case == base:
                continue
            r = ratio(runs, case, base, "chat", "itl_p99_ms")
            t = ratio(runs, case, base, "chat", "ttft_p50_ms")
            lines.append(
                f"* {case} against colocated, same-round ratios (median): chat ITL p99 "
                f"x {r:.2f}, chat TTFT p50 x {t:.2f}."
            )
    return "\n".join(lines)
