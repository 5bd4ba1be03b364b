"""The markdown report of ``bench.overhead``.

A library for that script, not a script: :func:`report` turns the result (the JSON the script
writes) into the markdown it prints: one row per scenario and mode (throughput and its ratio to
direct, latency, added latency and TTFT, CPU per request and minus the floor's, errors), the
first issue's targets with PASS/FAIL and issue #29's with met / not met
(:mod:`bench.overhead.targets`), the router against the baseline when ``--baseline-tree`` was
given, the diagnostics table, memory (peak RSS per mode) and background CPU, the modes that
could not run and why, and warnings.
"""

from __future__ import annotations

from typing import Any

from bench.common.output import OTHER_LOAD_WARN_PCT
from bench.overhead.load import STREAM_ITL_MS, STREAM_TOKENS, STREAM_TTFT_MS, key
from bench.overhead.targets import issue29_rows, target_rows


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    text = f"{value:.{digits}f}"
    return text.removeprefix("-") if float(text) == 0 else text  # no "-0.000"


def mark(ok: bool | None) -> str:
    """PASS / FAIL, or "info" for rows that have no limit of their own."""
    return "info" if ok is None else "PASS" if ok else "FAIL"


def met(ok: bool | None) -> str:
    return "n/a" if ok is None else "met" if ok else "**not met**"


def modes_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| scenario | mode | req/s | vs direct | p50 / p99 ms | added p50 ms | TTFT p50 ms "
        "| added TTFT p50 ms | CPU ms/req | minus floor ms/req | errors |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        for mode in s["modes"]:
            k = key(mode)
            g = s.get
            lines.append(
                f"| {s['scenario']} | {mode} | {s[f'{k}_rps']:.0f} | {fmt(g(f'{k}_ratio'), 3)} "
                f"| {fmt(s[f'{k}_p50_ms'])} / {fmt(s[f'{k}_p99_ms'])} "
                f"| {fmt(g(f'{k}_added_p50_ms'))} | {fmt(g(f'{k}_ttft_p50_ms'))} "
                f"| {fmt(g(f'{k}_added_ttft_p50_ms'))} | {fmt(g(f'{k}_cpu_ms_per_req'), 3)} "
                f"| {fmt(g(f'{k}_minus_floor_cpu_ms_per_req'), 3)} | {s[f'{k}_errors']} |"
            )
    return lines


def baseline_lines(result: dict[str, Any]) -> list[str]:
    """The router against the baseline, only when --baseline-tree was given."""
    tree = result["config"].get("baseline_tree")
    if not tree:
        return []
    lines = [
        "",
        f"Baseline (--baseline-tree {tree}: a second router from that checkout, same command, "
        "flags, environment and workers, its own database; its rows are above):",
        "",
        "| scenario | router / baseline req/s | router minus baseline CPU ms/req |",
        "|---|--:|--:|",
    ]
    for s in result["scenarios"]:
        lines.append(
            f"| {s['scenario']} | {s['router_rps'] / s['baseline_rps']:.3f} "
            f"| {s['router_cpu_ms_per_req'] - s['baseline_cpu_ms_per_req']:.3f} |"
        )
    return lines


def diagnostics_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| scenario | mode | machine CPU busy % | other load % | user / sys ms/req "
        "| client CPU ms/req |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for s in summaries:
        for mode in s["modes"]:
            k = key(mode)
            split = "-"
            if f"{k}_user_ms_per_req" in s:
                split = f"{s[f'{k}_user_ms_per_req']:.3f} / {s[f'{k}_sys_ms_per_req']:.3f}"
            lines.append(
                f"| {s['scenario']} | {mode} | {s[f'machine_busy_pct_{k}']:.0f} "
                f"| {s['other_busy_pct']:.0f} | {split} "
                f"| {s[f'client_cpu_ms_per_req_{k}']:.3f} |"
            )
    return lines


def memory_lines(result: dict[str, Any]) -> list[str]:
    mem, modes = result["memory"], result["modes"]
    peaks = ", ".join(f"{m} {mem[f'{key(m)}_peak_rss_mib']:.1f}" for m in modes if m != "direct")
    idle = ", ".join(f"{m} {result['idle_cpu_ms_per_s'][m]:.1f}" for m in modes if m != "direct")
    return [
        f"Peak RSS (VmHWM summed over each server's processes; for a Rust router the larger of "
        f"its two instances, one per model), MiB: {peaks}.",
        f"Router RSS: {mem['router_rss_start_mib']:.1f} MiB after start-up, "
        f"{mem['router_rss_end_mib']:.1f} MiB at the end.",
        f"Background CPU, measured around the rounds where a proxy serves nothing, ms/s: {idle}; "
        "included in the CPU figures above.",
    ]


def report(result: dict[str, Any]) -> str:
    m, summaries = result["machine"], result["scenarios"]
    lines = [
        f"## Router overhead — {m['date']}",
        "",
        f"Machine: nproc {m['nproc']}, {m['cpu_model']}, Python {m['python']}, "
        f"kernel {m['kernel']}. Rounds: {result['config']['rounds']} per scenario "
        f"(medians shown){', quick mode' if result['config']['quick'] else ''}. "
        f"Modes: {', '.join(result['modes'])}. "
        f"The routers' policy: {result['config'].get('router_policy', 'default')}.",
    ]
    for mode, why in result.get("unavailable", {}).items():
        lines.append(f"**{mode} was not measured**: {why}")
    lines += [
        "",
        '"vs direct" = req/s over direct\'s; "added" = the mode minus direct; "minus floor" = '
        "its CPU per request minus the floor proxy's (bench/common/floor_proxy.py).",
        "",
        *modes_table(summaries),
        "",
        "| target | measured | limit | result |",
        "|---|--:|--:|:-:|",
    ]
    for label, value, limit, ok in target_rows(result):
        lines.append(f"| {label} | {value} | {limit} | {mark(ok)} |")
    lines += ["", "Targets of issue #29 (medians):", ""]
    lines += ["| target | measured | limit | result |", "|---|--:|--:|:-:|"]
    for label, value, limit, ok in issue29_rows(result):
        lines.append(f"| {label} | {value} | {limit} | {met(ok)} |")
    lines += baseline_lines(result)
    lines += ["", "Diagnostics (medians over rounds):", "", *diagnostics_table(summaries), ""]
    lines += memory_lines(result)
    noisy = [s["scenario"] for s in summaries if s["other_busy_pct"] > OTHER_LOAD_WARN_PCT]
    if noisy:
        lines.append(
            f"WARNING: other processes kept the CPUs more than {OTHER_LOAD_WARN_PCT:.0f} % busy "
            f"during: {', '.join(noisy)}. Those figures are unreliable; rerun on a quiet machine."
        )
    for s in summaries:
        if "nominal_rps" in s:
            lines.append(
                f"{s['scenario']}: nominal {s['concurrency']} x ({STREAM_TTFT_MS:g} ms + "
                f"{STREAM_TOKENS - 1} x {STREAM_ITL_MS:g} ms) = {s['nominal_rps']:.1f} req/s; "
                f"direct reached {s['direct_rps']:.1f} (timer overshoot, CPU contention)."
            )
    return "\n".join(lines)
