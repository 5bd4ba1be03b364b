"""The figures and the markdown report of ``bench.real_vllm``.

A library for that script, not a script: :func:`run_figures` turns one run (the client's
samples and the counters' deltas, bench/real_vllm/fleet.py) into its figures; :func:`summary`
takes the median of each figure over rounds, and of the per-round ratios of TTFT to round
robin's; :func:`report` prints them.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench.common.output import percentile
from bench.real_vllm.fleet import MODEL, MODES
from bench.real_vllm.workload import Outcome

DECISIONS = ("kv", "pending", "miss", "fallback", "load", "prefix")


def increase(run: dict[str, Any], name: str, **labels: str) -> float:
    """The sum of a router sample's increases over the samples whose labels include `labels`."""
    changes: list[tuple[dict[str, str], float]] = run["router"].get(name, [])
    return sum(change for have, change in changes if labels.items() <= have.items())


def by_label(run: dict[str, Any], name: str, label: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for have, change in run["router"].get(name, []):
        if labels.items() <= have.items():
            key = have.get(label, "?")
            out[key] = out.get(key, 0.0) + change
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def run_figures(mode: str, outcome: Outcome, run: dict[str, Any]) -> dict[str, Any]:
    policy = MODES[mode]["policy"]
    ok = [s for s in outcome.samples if s.ok]
    ttfts = [1000 * s.ttft_s for s in ok]
    who = {"model": MODEL, "policy": policy}
    checked = increase(run, "controlpanel_router_cache_prediction_error_tokens_count", **who)
    error_sum = increase(run, "controlpanel_router_cache_prediction_error_tokens_sum", **who)
    decisions = by_label(run, "controlpanel_router_policy_decisions_total", "decision", model=MODEL)
    n_decisions = sum(decisions.values())
    return {
        "requests": len(outcome.samples),
        "errors": len(outcome.samples) - len(ok),
        "error_examples": sorted({s.error for s in outcome.samples if s.error})[:3],
        "wall_s": outcome.wall_s,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p95_ms": percentile(ttfts, 95),
        "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else math.nan,
        "hit_rate": ratio(run["hits"], run["queries"]),
        "prefix_queries": run["queries"],
        "prefix_hits": run["hits"],
        "preemptions": run["preemptions"],
        "engine_ttft_mean_ms": ratio(1000 * run["engine_ttft_s"], run["engine_firsts"]),
        "client_cached_share": ratio(
            sum(s.cached_tokens for s in ok), sum(s.prompt_tokens for s in ok)
        ),
        "checked": checked,
        "within_block": increase(
            run, "controlpanel_router_cache_predictions_within_block_total", **who
        ),
        "accuracy": ratio(
            increase(run, "controlpanel_router_cache_predictions_within_block_total", **who),
            checked,
        ),
        "mean_abs_error_tokens": ratio(error_sum, checked),
        "predicted_tokens": increase(
            run, "controlpanel_router_cache_predicted_tokens_total", **who
        ),
        "reported_tokens": increase(run, "controlpanel_router_cache_reported_tokens_total", **who),
        "unchecked": increase(run, "controlpanel_router_cache_predictions_unchecked_total", **who),
        "decisions": decisions,
        "decision_shares": {k: ratio(v, n_decisions) for k, v in decisions.items()},
        "fallbacks": by_label(
            run, "controlpanel_router_kv_aware_fallbacks_total", "reason", model=MODEL
        ),
        "malformed": increase(run, "controlpanel_router_kv_events_malformed_total"),
        "gaps": increase(run, "controlpanel_router_kv_events_gaps_total"),
        "tokenize": by_label(
            run, "controlpanel_router_tokenize_requests_total", "outcome", model=MODEL
        ),
        "router_cpu_ms_per_request": ratio(1000 * run["router_cpu_s"], len(outcome.samples)),
        "samples": [  # user, turn, TTFT ms, prompt tokens, cached tokens
            [s.user, s.turn, round(1000 * s.ttft_s, 2), s.prompt_tokens, s.cached_tokens]
            for s in ok
        ],
    }


def median(values: list[float]) -> float:
    good = [v for v in values if not math.isnan(v)]
    return statistics.median(good) if good else math.nan


SCALARS = (
    "hit_rate", "client_cached_share", "ttft_p50_ms", "ttft_p95_ms", "ttft_mean_ms", "accuracy",
    "mean_abs_error_tokens", "router_cpu_ms_per_request", "wall_s", "engine_ttft_mean_ms",
)  # fmt: skip
SUMS = ("requests", "errors", "checked", "within_block", "predicted_tokens", "reported_tokens",
        "unchecked", "malformed", "gaps", "preemptions")  # fmt: skip


def summary(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """mode -> medians over rounds (SCALARS), totals over rounds (SUMS and the decision,
    fallback and tokenize counts; accuracy pooled from them), and the medians of per-round
    ratios to round_robin."""
    modes = [m for m in MODES if any(m in r for r in rounds)]
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        runs = [r[mode] for r in rounds if mode in r]
        fig: dict[str, Any] = {k: median([run[k] for run in runs]) for k in SCALARS}
        fig.update({k: sum(run[k] for run in runs) for k in SUMS})
        fig["accuracy"] = ratio(fig["within_block"], fig["checked"])  # pooled over rounds
        for key in ("decisions", "fallbacks", "tokenize"):
            total: dict[str, float] = {}
            for run in runs:
                for k, v in run[key].items():
                    total[k] = total.get(k, 0.0) + v
            fig[key] = total
        n = sum(fig["decisions"].values())
        fig["decision_shares"] = {k: ratio(v, n) for k, v in fig["decisions"].items()}
        for q in ("p50", "p95"):
            fig[f"ttft_{q}_vs_rr"] = median(
                [
                    ratio(r[mode][f"ttft_{q}_ms"], r["round_robin"][f"ttft_{q}_ms"])
                    for r in rounds
                    if mode in r and "round_robin" in r
                ]
            )
        out[mode] = fig
    return out


def pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f} %"


def num(x: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def shares(counts: dict[str, float]) -> str:
    total = sum(counts.values())
    if not total:
        return "-"
    return ", ".join(f"{k} {100 * v / total:.0f} %" for k, v in sorted(counts.items()) if v)


def counts(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(values.items()) if v) or "0"


def report(result: dict[str, Any]) -> str:
    s = result["summary"]
    setup = result["setup"]
    lines = [
        f"## Real vLLM (`bench.real_vllm`), {result['machine']['date']}",
        "",
        f"Machine: {result['machine']['nproc']} cores, {result['machine']['cpu_model']}, "
        f"load average {setup['loadavg_before']} before, {setup['loadavg_after']} after. "
        f"Router from commit {setup['source']['commit']}"
        + (
            f" with {len(setup['source']['changed'])} files changed"
            if setup["source"]["changed"]
            else ""
        )
        + ".",
        f"vLLM {setup['vllm_version']} (CPU), model `{MODEL}` (tiny random-weight Llama, "
        "SmolLM2 tokenizer, float32, eager), two servers, block size "
        f"{setup['block_size']}, `--num-gpu-blocks-override {setup['cache_blocks']}` each "
        f"({setup['cache_blocks'] * setup['block_size']} tokens); servers started in "
        f"{setup['servers_start_s']:.0f} s.",
        f"Workload (seed {setup['shape']['seed']}): {setup['shape']['groups']} system prompts "
        f"of {setup['shape']['system_words']} words x {setup['shape']['users_per_group']} "
        f"users each, {setup['shape']['min_turns']}-{setup['shape']['max_turns']} turns of "
        f"{setup['shape']['user_words'][0]}-{setup['shape']['user_words'][1]} words, "
        f"{setup['shape']['max_tokens']}-token answers, {setup['requests_per_run']} requests "
        f"per run, {setup['clients']} clients. About {setup['distinct_blocks']} distinct "
        f"blocks in the conversation set: {setup['distinct_blocks'] / setup['cache_blocks']:.2f}"
        f" x one server's cache, {setup['distinct_blocks'] / (2 * setup['cache_blocks']):.2f} x"
        " both.",
        f"Cold start of every run: `POST /reset_prefix_cache` on both (dev mode) and the "
        f"router's indexes emptied: median {setup['reset_s_median']:.1f} s. "
        f"Rounds: {setup['rounds']} (mode order rotated each round); medians over rounds.",
        "",
        "| mode | hit rate (vLLM) | TTFT p50 ms | p95 ms | p50 / RR | p95 / RR | accuracy "
        "| mean abs err tok | predicted / reported tok | decisions | fallbacks | tokenize "
        "| router CPU ms/req | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, f in s.items():
        lines.append(
            f"| {mode} | {pct(f['hit_rate'])} | {num(f['ttft_p50_ms'])} | "
            f"{num(f['ttft_p95_ms'])} | {num(f['ttft_p50_vs_rr'], 2)} | "
            f"{num(f['ttft_p95_vs_rr'], 2)} | {pct(f['accuracy'])} | "
            f"{num(f['mean_abs_error_tokens'])} | "
            f"{f['predicted_tokens']:.0f} / {f['reported_tokens']:.0f} | "
            f"{shares(f['decisions'])} | {counts(f['fallbacks'])} | {counts(f['tokenize'])} | "
            f"{num(f['router_cpu_ms_per_request'], 2)} | {f['errors']:.0f} |"
        )
    malformed = sum(f["malformed"] for f in s.values())
    lines += [
        "",
        f"Malformed KV messages over the whole run: {malformed:.0f} "
        f"({'PASS' if malformed == 0 else 'FAIL'}: must be 0); sequence gaps: "
        f"{sum(f['gaps'] for f in s.values()):.0f}.",
        "Accuracy: checked predictions within one block of `cached_tokens` (prefix_aware "
        "predicts in 16-token blocks), pooled over all rounds; mean absolute error: median "
        "over rounds; predicted / reported: token sums over all rounds; "
        "decisions, fallbacks and tokenize outcomes: totals over all rounds.",
        "Predictions more than a block off, by the decision that made them and whether "
        "they said more or less than vLLM (all rounds, from the router's access log): "
        + "; ".join(
            f"{m}: {counts(t) if t else 'none'}"
            for m, t in setup.get("mispredictions", {}).items()
            if m != "round_robin"
        )
        + ".",
        "Client-side cached share (usage): "
        + ", ".join(f"{m} {pct(f['client_cached_share'])}" for m, f in s.items())
        + ". vLLM's own mean TTFT (ms): "
        + ", ".join(f"{m} {num(f['engine_ttft_mean_ms'])}" for m, f in s.items())
        + ". Preemptions (all rounds): "
        + ", ".join(f"{m} {f['preemptions']:.0f}" for m, f in s.items())
        + ".",
    ]
    if setup.get("notes"):
        lines += ["", *[f"Note: {n}" for n in setup["notes"]]]
    return "\n".join(lines)
