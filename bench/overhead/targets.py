"""The targets ``bench.overhead`` judges, from the medians of a run.

A library for that script, not a script: :func:`target_rows` holds the first issue's limits
(PASS/FAIL: the router's CPU per tiny request, the stream throughput ratio and added TTFT, its
peak RSS; the stack floor's CPU beside them, informational); :func:`issue29_rows` issue #29's
(met / not met): CPU per tiny request (c=32) no more than vllm-router's, CPU per stream and per
prefix request at most 1.2 x the floor's, added TTFT p50 at most vllm-router's + 0.5 ms, peak
RSS at most 100 MiB. A target whose reference mode did not run says so instead of a verdict.
"""

from __future__ import annotations

from typing import Any

# The first issue's targets, printed with PASS/FAIL beside the figures.
CPU_TARGET_MS = 0.3
STREAM_RATIO_TARGET = 0.97
TTFT_TARGET_MS = 2.0
RSS_TARGET_MIB = 150.0
# Issue #29's.
PEER = "vllm_router"  # the Rust router the router's CPU and TTFT are held against
TINY_SCENARIO = "tiny c=32"
FLOOR_FACTOR = 1.2
TTFT_SLACK_MS = 0.5
RSS_29_MIB = 100.0

Row = tuple[str, str, str, bool | None]


def floor_target_row(summaries: list[dict[str, Any]]) -> Row | None:
    """Informational: is the router's CPU target reachable with this stack at all?"""
    tiny = [s for s in summaries if s["scenario"].startswith("tiny")]
    if not tiny:
        return None
    values = " / ".join(f"{s['floor_cpu_ms_per_req']:.3f}" for s in tiny)
    names = " / ".join(s["scenario"].removeprefix("tiny ") for s in tiny)
    return (
        "stack floor (uvicorn + aiohttp) CPU per tiny request",
        f"{values} ms ({names})",
        f"(router target <= {CPU_TARGET_MS} ms)",
        None,
    )


def target_rows(result: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for s in result["scenarios"]:
        if s["scenario"].startswith("tiny"):
            cpu = s["router_cpu_ms_per_req"]
            rows.append(
                (f"router CPU per request, {s['scenario']}", f"{cpu:.3f} ms",
                 f"<= {CPU_TARGET_MS} ms", cpu <= CPU_TARGET_MS)
            )  # fmt: skip
        elif s["stream"]:
            ratio, ttft = s["ratio"], s["added_ttft_p50_ms"]
            rows.append(
                (f"throughput ratio, {s['scenario']}", f"{ratio:.3f}",
                 f">= {STREAM_RATIO_TARGET}", ratio >= STREAM_RATIO_TARGET)
            )  # fmt: skip
            rows.append(
                (f"added TTFT p50, {s['scenario']}", f"{ttft:.2f} ms",
                 f"<= {TTFT_TARGET_MS} ms", ttft <= TTFT_TARGET_MS)
            )  # fmt: skip
    floor_row = floor_target_row(result["scenarios"])
    if floor_row is not None:
        rows.append(floor_row)
    rss = result["memory"]["router_peak_rss_mib"]
    rows.append(
        ("router peak RSS (VmHWM)", f"{rss:.1f} MiB", f"<= {RSS_TARGET_MIB:.0f} MiB",
         rss <= RSS_TARGET_MIB)
    )  # fmt: skip
    return rows


def issue29_rows(result: dict[str, Any]) -> list[Row]:
    """Issue #29's targets; None in the last column when the reference was not measured."""
    rows: list[Row] = []
    for s in result["scenarios"]:
        cpu = s["router_cpu_ms_per_req"]
        if s["scenario"] == TINY_SCENARIO:
            peer = s.get(f"{PEER}_cpu_ms_per_req")
            label = f"router CPU per request, {s['scenario']}"
            if peer is None:
                rows.append((label, f"{cpu:.3f} ms", "<= vllm-router's (not measured)", None))
            else:
                rows.append((label, f"{cpu:.3f} ms", f"<= vllm-router's {peer:.3f} ms",
                             cpu <= peer))  # fmt: skip
        elif s["stream"] or s["scenario"].startswith("prefix"):
            limit = FLOOR_FACTOR * s["floor_cpu_ms_per_req"]
            rows.append(
                (f"router CPU per request, {s['scenario']}", f"{cpu:.3f} ms",
                 f"<= {FLOOR_FACTOR} x floor = {limit:.3f} ms", cpu <= limit)
            )  # fmt: skip
        if s["stream"]:
            ttft = s["router_added_ttft_p50_ms"]
            label = f"added TTFT p50, {s['scenario']}"
            peer = s.get(f"{PEER}_added_ttft_p50_ms")
            if peer is None:
                rows.append((label, f"{ttft:.2f} ms", "<= vllm-router's + 0.5 ms (not measured)",
                             None))  # fmt: skip
            else:
                limit = peer + TTFT_SLACK_MS
                rows.append((label, f"{ttft:.2f} ms",
                             f"<= vllm-router's {peer:.2f} + {TTFT_SLACK_MS} = {limit:.2f} ms",
                             ttft <= limit))  # fmt: skip
    rss = result["memory"]["router_peak_rss_mib"]
    rows.append(("router peak RSS (VmHWM)", f"{rss:.1f} MiB", f"<= {RSS_29_MIB:.0f} MiB",
                 rss <= RSS_29_MIB))  # fmt: skip
    return rows
