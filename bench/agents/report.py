"""The report of ``bench.agents``: medians over rounds, same-round ratios, the targets.

A library for that script, not a script. :func:`report` returns the markdown and the targets
(issue 30): agent sessions keep >= 0.98 x the client oracle's hit rate with two replicas
(median of same-round ratios; one router's is shown beside it), and in a saturated pool every
agent's share is within 0.07 of its weight's share (median over rounds). Each session's share
against its due share (its agent's, split equally between the agent's sessions) and TTFT p50 /
p99 per session are reported, not judged.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from bench.agents.workload import AGENTS
from bench.replicas.setups import LABELS, ORACLE, REPLICAS2

HIT_TARGET = 0.98  # hit rate / the oracle's, two replicas
SHARE_TOLERANCE = 0.07  # |share - weight / all weights|, every agent

Mode = tuple[str, str]  # (set-up, policy)
Runs = list[dict[str, Any]]


def med(values: list[float | None]) -> float:
    got = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(got) if got else math.nan


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def by_mode(runs: list[dict[str, Any]]) -> dict[Mode, list[dict[str, Any]]]:
    out: dict[Mode, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        out[(r["setup"], r["policy"])].append(r)
    return dict(out)


def label(mode: Mode) -> str:
    setup, policy = mode
    return LABELS[setup] if setup == ORACLE else f"{LABELS[setup]}, {policy}"


def hit_ratio(
    runs: list[dict[str, Any]], oracle: list[dict[str, Any]]
) -> tuple[float, list[float]]:
    """Median over rounds of the hit rate over the oracle's in the same round."""
    base = {r["round"]: r["hit_rate"] for r in oracle}
    ratios = [
        r["hit_rate"] / base[r["round"]]
        for r in runs
        if r["hit_rate"] is not None and base.get(r["round"])
    ]
    return med(ratios), [round(x, 3) for x in ratios]


def share_of(rs: list[dict[str, Any]], who: str) -> float:
    return med([r["share"].get(who) for r in rs])


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    modes, due = by_mode(result["runs"]), result["due"]
    oracle = modes.get((ORACLE, ORACLE), [])
    out = []
    for (setup, policy), rs in modes.items():
        if setup == ORACLE:
            continue
        ratio, per = hit_ratio(rs, oracle)
        out.append({
            "what": f"{label((setup, policy))}: hit rate / oracle's >= {HIT_TARGET}",
            "value": ratio, "per_round": per,
            "judged": setup == REPLICAS2,
            "ok": ratio >= HIT_TARGET if not math.isnan(ratio) else None,
        })  # fmt: skip
        worst = max(abs(share_of(rs, a) - due[a]) for a in AGENTS)
        out.append({
            "what": f"{label((setup, policy))}: every agent's share within "
            f"{SHARE_TOLERANCE} of its weight's", "value": worst, "per_round": [],
            "judged": True, "ok": worst <= SHARE_TOLERANCE if not math.isnan(worst) else None,
        })  # fmt: skip
    return out


def verdict(t: dict[str, Any]) -> str:
    if t["ok"] is None:
        return "n/a"
    if not t["judged"]:
        return "(shown)"
    return "PASS" if t["ok"] else "FAIL"


def summary_table(result: dict[str, Any]) -> list[str]:
    modes = by_mode(result["runs"])
    oracle = modes.get((ORACLE, ORACLE), [])
    lines = [
        "| mode | hit rate | / oracle | TTFT p50 ms | TTFT p99 ms "
        "| requests per worker, busiest first "
        "| window s | completions | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, rs in modes.items():
        ratio, _ = hit_ratio(rs, oracle)
        busiest = [sorted(r["per_worker"], reverse=True) for r in rs]
        workers = [statistics.median(c) for c in zip(*busiest, strict=True)]
        lines.append(
            f"| {label(mode)} | {fmt(med([r['hit_rate'] for r in rs]), 3)} | {fmt(ratio, 3)} "
            f"| {fmt(med([r['ttft_p50_ms'] for r in rs]))} "
            f"| {fmt(med([r['ttft_p99_ms'] for r in rs]))} | {[round(w) for w in workers]} "
            f"| {fmt(med([r['window_s'] for r in rs]))} "
            f"| {fmt(med([r['completions'] for r in rs]), 0)} "
            f"| {sum(r['errors'] for r in rs)} |"
        )
    return lines


def share_table(result: dict[str, Any]) -> list[str]:
    modes, due = by_mode(result["runs"]), result["due"]
    names = list(modes)
    lines = [
        "| agent | weight | due | " + " | ".join(label(m) for m in names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for agent, weight in AGENTS.items():
        cells = [fmt(share_of(modes[m], agent), 3) for m in names]
        lines.append(f"| {agent} | {weight:g} | {due[agent]:.3f} | " + " | ".join(cells) + " |")
    worst = []
    for m in names:
        devs = [abs(share_of(modes[m], k) - due[k]) for k in result["sessions"]]
        worst.append(fmt(max(devs), 3))
    lines.append("| every session: worst distance from its due share | | | " + " | ".join(worst))
    return lines


def session_table(result: dict[str, Any]) -> list[str]:
    modes = by_mode(result["runs"])
    names = list(modes)
    lines = [
        "| session | agent | turns | " + " | ".join(label(m) for m in names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for key, info in sorted(result["sessions"].items(), key=lambda kv: kv[1]["index"]):
        cells = []
        for m in names:
            figures = [r["sessions"][key] for r in modes[m]]
            p50 = med([f["ttft_p50_ms"] for f in figures])
            p99 = med([f["ttft_p99_ms"] for f in figures])
            cells.append(f"{fmt(p50, 0)} / {fmt(p99, 0)}")
        lines.append(
            f"| {key[:8]} | {info['agent']} | {info['turns']} | " + " | ".join(cells) + " |"
        )
    return lines


def report(result: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    found = targets(result)
    machine, config = result["machine"], result["config"]
    pool = (
        f"CONTROLPANEL_MAX_INFLIGHT_PER_WORKER={config['per_worker']}"
        if config["per_worker"]
        else f"the model's max_inflight = {result['slots']}"
    )
    lines = [
        "# Coding agents through the router (issue 30, item 5)",
        "",
        f"Machine: {machine['nproc']} cores, {machine['cpu_model']}, Python "
        f"{machine['python']}, kernel {machine['kernel']}, {machine['date']}; "
        f"{result['duration_s']} s; {config['rounds']} rounds (medians; ratios are medians "
        "of same-round ratios).",
        "",
        f"Workload: {result['workload']}.",
        f"Pool: {pool} slots for {len(result['sessions'])} sessions sending; the oracle "
        f"(session i to worker i mod 4, every turn) has as many requests in flight at most, "
        "first come first served. Cache: "
        f"{result['working_set']['cache_blocks_per_worker']} blocks per worker "
        f"(40 % of the {result['working_set']['working_set_blocks']}-block working set).",
        "",
        "## Targets",
        "",
        *[f"* {verdict(t)}: {t['what']}: {fmt(t['value'], 3)}"
          + (f" (rounds {t['per_round']})" if t["per_round"] else "") for t in found],
        "",
        "## Hit rate and TTFT",
        "",
        *summary_table(result),
        "",
        "## Shares of the saturated pool (completions in the window when every session sends)",
        "",
        *share_table(result),
        "",
        "The oracle has no weights (first come first served); its row shows what the sessions"
        " get without the fair queue.",
        "",
        "## TTFT per session, p50 / p99 ms",
        "",
        *session_table(result),
    ]  # fmt: skip
    if result["celery_restarts"]:
        lines += ["", f"Celery restarts: {result['celery_restarts']}"]
    return "\n".join(lines), found
