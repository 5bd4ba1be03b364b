"""The markdown report of ``bench.routing``, with the issue's targets.

A library for that script, not a script: :func:`report` turns the result (the JSON the script
writes) into the markdown it prints: the set-up and the cache sizing, one table per workload,
the targets with PASS/FAIL (judged on the median of per-round ratios, :func:`ratio_row`), what
the proxy hop costs and where the CPU goes on ``prefix``, the session affinity phase, the
issue's reference figures and the notes (skipped policies, Celery restarts, errors, other load).
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

from bench.common.output import OTHER_LOAD_WARN_PCT
from bench.routing.churn import kv_lines, kv_rows
from bench.routing.fleet import (
    BLOCK_SIZE,
    ITL_MS,
    MAX_BATCH,
    MAX_TOKENS,
    N_WORKERS,
    PROBE_INTERVAL_S,
    TTFT_MS,
)
from bench.routing.load import CONCURRENCY
from bench.routing.modes import policy_of
from bench.routing.workloads import SEED, sizing_lines

# Targets from the issue.
HIT_RATE_TARGET = 0.85
TTFT_VS_ORACLE = 1.25
SKEW_P99_VS_SQ = 1.10
UNIFORM_TOLERANCE = 0.10
STICKY_TARGET = 0.95

# Reference figures from the issue: (hit rate, mean TTFT), measured by the author.
PEER_FIGURES = (
    ("client-side oracle", "0.87", "43 ms"),
    ("SGLang router, cache_aware", "0.87", "76 ms"),
    ("vllm-router, cache_aware", "0.87", "61 ms"),
    ("round robin", "0.37-0.40", "220-240 ms"),
)


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def mark(ok: bool | None) -> str:
    return "n/a" if ok is None else "PASS" if ok else "FAIL"


def find(runs: list[dict[str, Any]], workload: str, mode: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["workload"] == workload and r["mode"] == mode), None)


KIND_NOTES = {
    "client": " (baseline, no router)",
    "floor": " (the oracle's assignment through the floor proxy)",
}


def workload_table(runs: list[dict[str, Any]], workload: str) -> list[str]:
    lines = [
        "| mode | TTFT mean ms | engine TTFT / queue wait ms | TTFT p50 ms | TTFT p99 ms "
        "| req/s | prefix hit rate "
        "| requests per worker | errors | proxy CPU ms/req | policy decisions "
        "| prediction accuracy (checked) |",
        "|---|--:|--:|--:|--:|--:|--:|---|--:|--:|---|--:|",
    ]
    for r in runs:
        if r["workload"] != workload:
            continue
        label = r["mode"] + KIND_NOTES.get(r["kind"], "")
        decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["decisions"].items())) or "-"
        lines.append(
            f"| {label} | {fmt(r['ttft_mean_ms'])} "
            f"| {fmt(r.get('engine_ttft_ms', math.nan))} / {fmt(r.get('queue_wait_ms', math.nan))} "
            f"| {fmt(r['ttft_p50_ms'])} "
            f"| {fmt(r['ttft_p99_ms'])} | {fmt(r['rps'])} | {fmt(r['hit_rate'], 3)} "
            f"| {' / '.join(str(n) for n in r['per_worker'])} | {r['errors']} "
            f"| {fmt(r['router_cpu_ms_per_req'], 2) if r['kind'] != 'client' else '-'} "
            f"| {decisions} | {accuracy_cell(r)} |"
        )
    return lines


def accuracy_cell(r: dict[str, Any]) -> str:
    """The router's cache check of the run's policy: within one block / checked."""
    checks = r.get("checks") or {}
    if not checks.get("checked"):
        return "-"
    return f"{fmt(r['accuracy'], 3)} ({checks['checked']:.0f})"


def per_round(
    details: list[dict[str, Any]], workload: str, mode: str, key: str
) -> dict[int, float]:
    """round -> `key` of one mode's run in that round."""
    return {d["round"]: d[key] for d in details if d["workload"] == workload and d["mode"] == mode}


def round_ratios(
    details: list[dict[str, Any]], workload: str, mode: str, base: str, key: str
) -> list[float]:
    """`key` of `mode` over `base`'s, per round (both ran in it, minutes apart at most)."""
    a, b = per_round(details, workload, mode, key), per_round(details, workload, base, key)
    return [a[r] / b[r] for r in sorted(a) if b.get(r)]


def ratio_row(
    label: str, result: dict[str, Any], workload: str, mode: str, base: str, key: str,
    limit: float, higher_is_better: bool = False,
) -> tuple[str, str, str, bool | None]:  # fmt: skip
    """A target on the median over rounds of the per-round ratio (the pooled figures are
    shown too); per-round ratios cancel the drift of a shared machine between rounds."""
    ratios = round_ratios(result["rounds_detail"], workload, mode, base, key)
    value, ref = find(result["runs"], workload, mode), find(result["runs"], workload, base)
    if not ratios or value is None or ref is None:
        return label, "not measured", "", None
    ratio = statistics.median(ratios)
    measured = (
        f"median {ratio:.2f}x ({' / '.join(f'{x:.2f}' for x in ratios)}); pooled "
        f"{value[key]:.1f} vs {ref[key]:.1f}"
    )
    if higher_is_better:
        return label, measured, f">= {limit:.2f}x", ratio >= limit
    return label, measured, f"<= {limit:.2f}x", ratio <= limit


def target_rows(result: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    rows: list[tuple[str, str, str, bool | None]] = []
    hits = per_round(result["rounds_detail"], "prefix", "prefix_aware", "hit_rate")
    if not hits:
        rows.append(("prefix: prefix_aware hit rate", "not measured", "", None))
    else:
        hit = statistics.median(hits.values())
        rows.append(
            ("prefix: prefix_aware hit rate", f"median {hit:.3f} "
             f"({' / '.join(f'{x:.3f}' for x in hits.values())})", f">= {HIT_RATE_TARGET}",
             hit >= HIT_RATE_TARGET)
        )  # fmt: skip
    pa, sq = "prefix_aware", "shortest_queue"
    rows += [
        ratio_row("prefix: prefix_aware mean TTFT vs client oracle", result, "prefix", pa,
                  "client_oracle", "ttft_mean_ms", TTFT_VS_ORACLE),
        ratio_row("skewed: prefix_aware p99 TTFT vs shortest_queue", result, "skewed", pa, sq,
                  "ttft_p99_ms", SKEW_P99_VS_SQ),
        ratio_row("uniform: prefix_aware throughput vs shortest_queue", result, "uniform", pa, sq,
                  "rps", 1 - UNIFORM_TOLERANCE, higher_is_better=True),
        ratio_row("uniform: prefix_aware p99 TTFT vs shortest_queue", result, "uniform", pa, sq,
                  "ttft_p99_ms", 1 + UNIFORM_TOLERANCE),
    ]  # fmt: skip
    aff = result["affinity"]
    if aff is None:
        rows.append(("session_affinity: turns on the session's worker", "not measured", "", None))
        rows.append(("session_affinity: drain moves sessions, no errors", "not measured", "", None))
    else:
        share = aff["healthy_sticky_share"]
        rows.append(
            ("session_affinity: turns on the session's worker (all healthy)",
             f"{share:.3f} ({aff['healthy_fully_sticky_sessions']}/{aff['sessions']} sessions "
             "fully)", f">= {STICKY_TARGET}", share >= STICKY_TARGET)
        )  # fmt: skip
        ok = (
            aff["errors"] == 0
            and aff["after_drain_on_drained"] == 0
            and aff["drain"].get("drain_status") == 200
            and aff["moved_sessions"] > 0
        )
        rows.append(
            ("session_affinity: drain moves sessions, no errors",
             f"{aff['errors']} errors, {aff['after_drain_on_drained']} requests on the drained "
             f"worker after the router stopped routing to it, {aff['moved_sessions']} sessions "
             "moved", "0 errors, 0 on drained", ok)
        )  # fmt: skip
    return rows


KV_TTFT_VS_ORACLE = 1.10


def kv_target_rows(result: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """kv_aware against the client oracle and shortest_queue, in the same run (issue 15)."""
    kv, oracle, sq = "kv_aware", "client_oracle", "shortest_queue"
    return [
        ratio_row("prefix: kv_aware hit rate vs client oracle", result, "prefix", kv, oracle,
                  "hit_rate", 1.0, higher_is_better=True),
        ratio_row("prefix: kv_aware mean TTFT vs client oracle", result, "prefix", kv, oracle,
                  "ttft_mean_ms", KV_TTFT_VS_ORACLE),
        ratio_row("skewed: kv_aware p99 TTFT vs shortest_queue", result, "skewed", kv, sq,
                  "ttft_p99_ms", SKEW_P99_VS_SQ),
    ]  # fmt: skip


def oracle_ratio_lines(result: dict[str, Any]) -> list[str]:
    """Every mode over the client oracle, per workload: median of per-round ratios."""
    details = result["rounds_detail"]
    lines = [
        "Ratios to the client oracle (same run; median of per-round ratios):",
        "",
        "| workload | mode | hit rate / oracle | TTFT mean / oracle | TTFT p99 / oracle |",
        "|---|---|--:|--:|--:|",
    ]
    for r in result["runs"]:
        if r["mode"] == "client_oracle":
            continue
        cells = []
        for key in ("hit_rate", "ttft_mean_ms", "ttft_p99_ms"):
            ratios = round_ratios(details, r["workload"], r["mode"], "client_oracle", key)
            cells.append(f"{statistics.median(ratios):.2f}" if ratios else "-")
        lines.append(f"| {r['workload']} | {r['mode']} | {' | '.join(cells)} |")
    return lines


def hop_lines(result: dict[str, Any]) -> list[str]:
    """What the extra hop costs on this machine, to read the router-vs-oracle target by."""
    runs, details = result["runs"], result["rounds_detail"]
    lines = []
    via, direct = find(runs, "uniform", "round_robin"), find(runs, "uniform", "client_rr")
    if via is not None and direct is not None:
        lines.append(
            "* Router hop (uniform, round_robin through the router vs client_rr straight to "
            f"the workers, same assignment): TTFT mean {fmt(via['ttft_mean_ms'])} vs "
            f"{fmt(direct['ttft_mean_ms'])} ms "
            f"({via['ttft_mean_ms'] - direct['ttft_mean_ms']:+.1f} ms), throughput "
            f"{fmt(via['rps'])} vs {fmt(direct['rps'])} req/s ({via['rps'] / direct['rps']:.2f}x)."
        )
    for mode in ("floor_oracle", "prefix_aware"):
        ratios = round_ratios(details, "prefix", mode, "client_oracle", "ttft_mean_ms")
        row = find(runs, "prefix", mode)
        oracle = find(runs, "prefix", "client_oracle")
        if not ratios or row is None or oracle is None:
            continue
        what = (
            "the oracle's assignment through the floor proxy (uvicorn + aiohttp, no routing)"
            if mode == "floor_oracle"
            else "prefix_aware through the router"
        )
        lines.append(
            f"* prefix, {what} vs the client oracle: TTFT mean {fmt(row['ttft_mean_ms'])} vs "
            f"{fmt(oracle['ttft_mean_ms'])} ms pooled "
            f"({row['ttft_mean_ms'] - oracle['ttft_mean_ms']:+.1f} ms), median per-round ratio "
            f"{statistics.median(ratios):.2f}x ({' / '.join(f'{x:.2f}' for x in ratios)})."
        )
    if lines:
        lines.append(
            f"* The proxies share the {len(os.sched_getaffinity(0))} CPUs with the workers and "
            "the load generator, so these include CPU contention. If the floor proxy alone "
            f"exceeds {TTFT_VS_ORACLE:.2f}x the client oracle, no proxy on this stack can meet "
            "the mean-TTFT target on this machine, whatever it routes."
        )
    return lines


def cpu_table(result: dict[str, Any]) -> list[str]:
    """Where the CPU goes on `prefix`, per request, by process group (pooled rounds)."""
    runs = [r for r in result["runs"] if r["workload"] == "prefix"]
    groups = ["load generator", "workers", "router", "floor", "celery"]
    lines = [
        "CPU per request on `prefix` by process (ms; the machine has "
        f"{len(os.sched_getaffinity(0))} CPUs, so 1 s of wall time holds "
        f"{len(os.sched_getaffinity(0)) * 1000} ms):",
        "",
        f"| mode | {' | '.join(groups)} | all | machine busy % |",
        f"|---|{'--:|' * (len(groups) + 2)}",
    ]
    for r in runs:
        cpu = r["cpu_ms_per_req"]
        cells = " | ".join(fmt(cpu.get(g), 2) for g in groups)
        lines.append(
            f"| {r['mode']} | {cells} | {fmt(sum(cpu.values()), 2)} "
            f"| {fmt(r['machine_busy_pct'], 0)} |"
        )
    return lines


def affinity_lines(aff: dict[str, Any]) -> list[str]:
    d = aff["drain"]
    return [
        f"Session affinity phase: {aff['requests']} requests, {aff['errors']} errors "
        f"({aff['attributed']} attributed to a worker through the request logs, "
        f"{aff['possibly_missed_polls']} polls that may have missed some).",
        f"* healthy: {aff['healthy_attributed']} requests of {aff['sessions']} sessions; "
        f"{fmt(aff['healthy_sticky_share'], 3)} of them on their session's usual worker; "
        f"{aff['healthy_fully_sticky_sessions']} sessions entirely on one worker; sessions per "
        f"worker {aff['sessions_per_home']}.",
        f"* drain of worker {d.get('victim')} (id {d.get('worker_id')}): HTTP "
        f"{d.get('drain_status')}, state {d.get('state_after_post')} -> "
        f"{d.get('state_after_phase')} {fmt(d.get('drained_after_s'))} s after the request "
        "(once the router reported nothing in flight on it); the router stopped routing to it "
        f"{fmt(d.get('effective_after_s', math.nan) * 1000, 0)} ms after the request; "
        f"{aff['transition_requests']} requests were sent in between "
        f"({aff['transition_on_drained']} of them still went to it).",
        f"* after the drain: {aff['after_drain_requests']} requests, "
        f"{aff['after_drain_on_drained']} on the drained worker; its {aff['moved_sessions']} "
        f"sessions moved and kept {fmt(aff['moved_sticky_share'], 3)} of their later turns on "
        f"one new worker; the other {aff['other_sessions']} sessions kept "
        f"{fmt(aff['other_stayed_share'], 3)} of theirs on their old worker; sessions per worker "
        f"{aff['sessions_per_home_after']}.",
        f"* activate: HTTP {d.get('activate_status')}, state {d.get('state_after_activate')}.",
    ]


def report(result: dict[str, Any]) -> str:
    m, cfg = result["machine"], result["config"]
    lines = [
        f"## Routing policies — {m['date']}",
        "",
        f"Machine: nproc {m['nproc']}, {m['cpu_model']}, Python {m['python']}, kernel "
        f"{m['kernel']}. {N_WORKERS} simulated workers (--ttft-ms {TTFT_MS:g} "
        f"--prefill-ms-per-block {cfg['simulator']['prefill_ms_per_block']:g} --itl-ms "
        f"{ITL_MS:g} --max-batch {MAX_BATCH} --block-size {BLOCK_SIZE} --cache-blocks "
        f"{result['working_set']['cache_blocks_per_worker']}); streamed chat completions, "
        f"max_tokens {MAX_TOKENS}, at most {CONCURRENCY} in flight; seed {SEED}; every run "
        f"starts with cold caches; {cfg['rounds']} run(s) per workload and mode, figures "
        f"pooled over them{', quick mode' if cfg['quick'] else ''}; health probes every "
        f"{PROBE_INTERVAL_S:g} s. "
        f"Duration {result['duration_s']} s.",
        "",
        *sizing_lines(result["working_set"]),
    ]
    for name in result["workloads"]:
        if not any(r["workload"] == name for r in result["runs"]):
            continue
        desc = result["workloads"][name]
        lines += ["", f"### `{name}`: {desc}", "", *workload_table(result["runs"], name)]
    lines += ["", "### Targets", "", "| target | measured | limit | result |", "|---|---|--:|:-:|"]
    rows = target_rows(result)
    if cfg.get("kv"):
        rows += kv_target_rows(result) + kv_rows(result)
    for label, value, limit, ok in rows:
        lines.append(f"| {label} | {value} | {limit} | {mark(ok)} |")
    if cfg.get("kv"):
        lines += ["", *oracle_ratio_lines(result), "", *kv_lines(result)]
    hop = hop_lines(result)
    if hop:
        lines += ["", "What the hop costs on this machine:", "", *hop, "", *cpu_table(result)]
    if result["affinity"] is not None:
        lines += ["", *affinity_lines(result["affinity"])]
    lines += [
        "",
        "Reference figures from the issue (prefix workload; measured by the issue author on the "
        "same workload, not rerun here):",
        "",
        "| router | hit rate | mean TTFT |",
        "|---|--:|--:|",
        *(f"| {name} | {hit} | {ttft} |" for name, hit, ttft in PEER_FIGURES),
    ]
    notes = report_notes(result)
    if notes:
        lines += ["", "Notes:", "", *(f"* {n}" for n in notes)]
    return "\n".join(lines)


def report_notes(result: dict[str, Any]) -> list[str]:
    """Skipped policies, Celery restarts, unexpected decision counters, errors, other load."""
    notes = [f"{p} skipped: {why}" for p, why in result["skipped"].items()]
    notes += result["policy_api_notes"]
    notes += [f"baseline {m} not run (--skip-baseline)" for m in result["config"].get(
        "skipped_baselines", [])]  # fmt: skip
    for s in result.get("kv_streams", []):
        notes.append(
            f"KV events from {s['worker']} at the end: connected {s['connected']}, "
            f"{s['batches']} batches, {s['gaps']} gaps, replays {s['replays']}, malformed "
            f"{s['malformed']}, disconnects {s['disconnects']}; index {s['index_trust']}, "
            f"{s['index_blocks']} blocks, {s['index_clears']} clears, "
            f"{s['index_restarts']} restarts"
        )
    notes += [f"the Celery worker died and was restarted: {r}" for r in result["celery_restarts"]]
    for r in result["runs"]:
        seen = r["policy_seen"]
        if r["kind"] == "router" and seen and seen != [policy_of(r["mode"])]:
            notes.append(
                f"{r['workload']}/{r['mode']}: the router's decision counters name "
                f"{', '.join(r['policy_seen'])}"
            )
        if r["errors"]:
            notes.append(f"{r['workload']}/{r['mode']}: {r['errors']} errors {r['error_kinds']}")
    details = result["rounds_detail"]
    noisy = [d for d in details if d["other_busy_pct_max"] > OTHER_LOAD_WARN_PCT]
    if noisy:
        worst = max(d["other_busy_pct_max"] for d in noisy)
        notes.append(
            f"WARNING: processes outside this benchmark kept the CPUs more than "
            f"{OTHER_LOAD_WARN_PCT:.0f} % busy during {len(noisy)} of {len(details)} runs (up "
            f"to {worst:.0f} %); those figures are unreliable, rerun on a quiet machine "
            "(per-run figures in the JSON: other_busy_pct_max)"
        )
    return notes
