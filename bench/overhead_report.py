"""The markdown report of ``bench/overhead.py``, with the issue's targets.

A library for that script, not a script: :func:`report` turns the result (the JSON the script
writes) into the markdown it prints: the main figures table, the targets with PASS/FAIL (and
the informational stack-floor row), the stack floor table, the baseline table when
``--baseline-tree`` was given, the diagnostics table, memory and background CPU, and warnings.
"""

from __future__ import annotations

from typing import Any

from bench.harness import OTHER_LOAD_WARN_PCT
from bench.overhead_load import STREAM_ITL_MS, STREAM_TOKENS, STREAM_TTFT_MS

# Targets from the issue, printed with PASS/FAIL beside the figures.
CPU_TARGET_MS = 0.3
STREAM_RATIO_TARGET = 0.97
TTFT_TARGET_MS = 2.0
RSS_TARGET_MIB = 150.0


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def mark(ok: bool | None) -> str:
    """PASS / FAIL, or "info" for rows that have no limit of their own."""
    return "info" if ok is None else "PASS" if ok else "FAIL"


def figures_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| scenario | direct req/s | router req/s | ratio | direct p50 / p99 ms "
        "| router p50 / p99 ms | added p50 ms | added p99 ms | TTFT p50 direct / router ms "
        "| added TTFT p50 ms | router CPU ms/req | errors |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        ttft = "-"
        if "direct_ttft_p50_ms" in s:
            ttft = f"{fmt(s['direct_ttft_p50_ms'])} / {fmt(s['router_ttft_p50_ms'])}"
        lines.append(
            f"| {s['scenario']} | {s['direct_rps']:.0f} | {s['router_rps']:.0f} "
            f"| {s['ratio']:.3f} | {fmt(s['direct_p50_ms'])} / {fmt(s['direct_p99_ms'])} "
            f"| {fmt(s['router_p50_ms'])} / {fmt(s['router_p99_ms'])} "
            f"| {fmt(s['added_p50_ms'])} | {fmt(s['added_p99_ms'])} | {ttft} "
            f"| {fmt(s.get('added_ttft_p50_ms'))} | {s['router_cpu_ms_per_req']:.3f} "
            f"| {s['errors']} |"
        )
    return lines


def floor_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| scenario | floor req/s | floor / direct | router / floor | floor p50 / p99 ms "
        "| floor added p50 ms | floor added TTFT p50 ms | floor CPU ms/req | router CPU ms/req "
        "| router minus floor CPU ms/req |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['scenario']} | {s['floor_rps']:.0f} | {s['floor_ratio']:.3f} "
            f"| {s['router_floor_ratio']:.3f} "
            f"| {fmt(s['floor_p50_ms'])} / {fmt(s['floor_p99_ms'])} "
            f"| {fmt(s['floor_added_p50_ms'])} | {fmt(s.get('floor_added_ttft_p50_ms'))} "
            f"| {s['floor_cpu_ms_per_req']:.3f} | {s['router_cpu_ms_per_req']:.3f} "
            f"| {s['router_minus_floor_cpu_ms_per_req']:.3f} |"
        )
    return lines


def baseline_table(summaries: list[dict[str, Any]]) -> list[str]:
    """The router next to the baseline router: CPU, each minus the floor, throughput, TTFT."""
    lines = [
        "| scenario | router req/s | baseline req/s | router / baseline | router CPU ms/req "
        "| baseline CPU ms/req | router minus floor CPU ms/req "
        "| baseline minus floor CPU ms/req | router minus baseline CPU ms/req "
        "| added p50 ms router / baseline | added TTFT p50 ms router / baseline |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        ttft = "-"
        if "baseline_added_ttft_p50_ms" in s:
            ttft = f"{fmt(s['added_ttft_p50_ms'])} / {fmt(s['baseline_added_ttft_p50_ms'])}"
        lines.append(
            f"| {s['scenario']} | {s['router_rps']:.0f} | {s['baseline_rps']:.0f} "
            f"| {s['router_baseline_ratio']:.3f} | {s['router_cpu_ms_per_req']:.3f} "
            f"| {s['baseline_cpu_ms_per_req']:.3f} "
            f"| {s['router_minus_floor_cpu_ms_per_req']:.3f} "
            f"| {s['baseline_minus_floor_cpu_ms_per_req']:.3f} "
            f"| {s['router_minus_baseline_cpu_ms_per_req']:.3f} "
            f"| {fmt(s['added_p50_ms'])} / {fmt(s['baseline_added_p50_ms'])} | {ttft} |"
        )
    return lines


def baseline_lines(result: dict[str, Any]) -> list[str]:
    """The before/after section, only when --baseline-tree was given."""
    tree = result["config"].get("baseline_tree")
    if not tree:
        return []
    mem = result["memory"]
    return [
        "",
        f"Baseline (--baseline-tree {tree}: a second router from that checkout, same command, "
        "flags, environment and workers, its own database; measured in the same interleaved "
        "rounds, medians over rounds):",
        "",
        *baseline_table(result["scenarios"]),
        "",
        f"Baseline router peak RSS: {mem['baseline_peak_rss_mib']:.1f} MiB; background CPU "
        f"{result['baseline_idle_cpu_ms_per_s']:.1f} ms/s.",
    ]


def diagnostics_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| scenario | machine CPU busy % direct / floor / router | other load % "
        "| router user / sys ms/req | floor user / sys ms/req "
        "| client CPU ms/req direct / floor / router |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['scenario']} | {s['machine_busy_pct_direct']:.0f} / "
            f"{s['machine_busy_pct_floor']:.0f} / "
            f"{s['machine_busy_pct_router']:.0f} | {s['other_busy_pct']:.0f} "
            f"| {s['router_user_ms_per_req']:.3f} / {s['router_sys_ms_per_req']:.3f} "
            f"| {s['floor_user_ms_per_req']:.3f} / {s['floor_sys_ms_per_req']:.3f} "
            f"| {s['client_cpu_ms_per_req_direct']:.3f} / "
            f"{s['client_cpu_ms_per_req_floor']:.3f} / "
            f"{s['client_cpu_ms_per_req_router']:.3f} |"
        )
    return lines


def floor_target_row(summaries: list[dict[str, Any]]) -> tuple[str, str, str, None] | None:
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


def target_rows(result: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    rows: list[tuple[str, str, str, bool | None]] = []
    for s in result["scenarios"]:
        if s["scenario"].startswith("tiny"):
            cpu = s["router_cpu_ms_per_req"]
            rows.append(
                (f"router CPU per request, {s['scenario']}", f"{cpu:.3f} ms",
                 f"<= {CPU_TARGET_MS} ms", cpu <= CPU_TARGET_MS)
            )  # fmt: skip
        else:
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


def report(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"## Router overhead — {m['date']}",
        "",
        f"Machine: nproc {m['nproc']}, {m['cpu_model']}, Python {m['python']}, "
        f"kernel {m['kernel']}. Rounds: {result['config']['rounds']} per scenario "
        f"(medians shown){', quick mode' if result['config']['quick'] else ''}.",
        "",
        *figures_table(result["scenarios"]),
        "",
        "| target | measured | limit | result |",
        "|---|--:|--:|:-:|",
    ]
    for label, value, limit, ok in target_rows(result):
        lines.append(f"| {label} | {value} | {limit} | {mark(ok)} |")
    mem = result["memory"]
    lines += [
        "",
        "Stack floor (bench/floor_proxy.py: uvicorn with the router's flags, one aiohttp "
        'session, round-robin, nothing else; medians over rounds, "added" = floor minus '
        "direct):",
        "",
        *floor_table(result["scenarios"]),
    ]
    lines += baseline_lines(result)
    lines += ["", "Diagnostics (medians over rounds):", "", *diagnostics_table(result["scenarios"])]
    lines += [
        "",
        f"Router RSS: {mem['router_rss_start_mib']:.1f} MiB after start-up, "
        f"{mem['router_rss_end_mib']:.1f} MiB at the end, peak {mem['router_peak_rss_mib']:.1f} "
        f"MiB. Floor proxy peak RSS: {mem['floor_peak_rss_mib']:.1f} MiB.",
        f"Background CPU, measured around the rounds where a proxy serves nothing: router "
        f"{result['router_idle_cpu_ms_per_s']:.1f} ms/s, floor "
        f"{result['floor_idle_cpu_ms_per_s']:.1f} ms/s; included in the CPU figures above.",
    ]
    noisy = [
        s["scenario"] for s in result["scenarios"] if s["other_busy_pct"] > OTHER_LOAD_WARN_PCT
    ]
    if noisy:
        lines.append(
            f"WARNING: other processes kept the CPUs more than {OTHER_LOAD_WARN_PCT:.0f} % busy "
            f"during: {', '.join(noisy)}. Those figures are unreliable; rerun on a quiet machine."
        )
    for s in result["scenarios"]:
        if "nominal_rps" in s:
            lines.append(
                f"{s['scenario']}: nominal {s['concurrency']} x ({STREAM_TTFT_MS:g} ms + "
                f"{STREAM_TOKENS - 1} x {STREAM_ITL_MS:g} ms) = {s['nominal_rps']:.1f} req/s; "
                f"direct reached {s['direct_rps']:.1f} (timer overshoot, CPU contention)."
            )
    return "\n".join(lines)
