"""Which routing policy keeps the prefix caches warm? Every policy and two client-side
baselines on the same seeded workloads, in one run.

Set-up: four simulated vLLM workers (``python -m simulator``) serving one model with a
deliberately small prefix cache (sized from the ``prefix`` workload: each worker holds about 40 %
of its working set, the fleet 160 %), and timing that makes the cache matter: ``--ttft-ms 5
--prefill-ms-per-block 6 --itl-ms 2 --max-batch 8 --block-size 16``, so an uncached
1,024-word prompt (64 blocks) costs about 390 ms of prefill and a cached turn 10-40 ms. The
prefill cost is calibrated so that the two client-side baselines land where the issue's
reference figures for this workload put them (client oracle 43 ms mean TTFT, round robin
220-240 ms): prefill on a GPU is time the GPU spends, not CPU the router's machine spends,
and it is what a cache hit saves. (Until 2026-11-30 16:40 the default was 1 ms per block:
the baselines then measured 23-25 and 65 ms, and a Python proxy hop's few milliseconds of
CPU on two shared cores weighed as much as the cache; ``--prefill-ms-per-block 1`` still
reproduces that set-up.) One router (uvicorn serving
``controlpanel.asgi``) runs on a throw-away SQLite database with the four workers added through
``POST /api/workers``, and a Celery worker with beat (health probes and metrics scrapes every
second, drain housekeeping), as ``manage.py serve`` runs it. The load generator is this
script (aiohttp, streamed chat completions, ``max_tokens`` 16, 32 requests in flight at most).

Workloads (seeded, identical for every policy and baseline):

* ``prefix``: 16 groups x 8 users x 4 turns. Each group shares a 1,024-word system prompt; each
  user adds 24-40-word turns and the assistant's streamed answer is appended to the history, so
  turn k+1 extends turn k's prompt. A user's turns are sequential; all users are live at once.
* ``uniform``: as many single-turn requests of 256-512 unrelated random words.
* ``skewed``: like ``prefix`` (same request count), but half of the users share one hot system
  prompt and the other half are spread over 15 other groups.

Modes: every selected policy through the router (switched with ``PATCH /api/models/{name}``,
with the ``policy_config`` of POLICY_CONFIGS: prefix_aware's load thresholds sized for these
workers' batch of 8; ``prefix_aware@defaults`` runs it with ``{}``; unregistered policies are
skipped with a note), plus two baselines sent straight to the workers: ``client_rr`` (request
i goes to worker i mod 4) and ``client_oracle`` (group g always goes to worker g mod 4), and
``floor_oracle``: the oracle's assignment through ``bench/common/floor_proxy.py``, the
cheapest proxy on the router's stack, which shows what any proxy hop costs on this machine.
Targets are judged on the median over rounds of per-round ratios. Before every run all
workers get ``POST /sim/reset`` (cold caches, zeroed counters) and the router's policy
instance is a fresh one (a policy is switched away and back if the previous run used the
same one and config), so each run starts cold.

Figures per run: TTFT (send to the first SSE chunk carrying content) mean / p50 / p99,
throughput (successful requests / wall time), the fleet-wide prefix-cache hit rate from the
workers' own counters (sum of ``vllm:prefix_cache_hits_total`` deltas / sum of
``vllm:prefix_cache_queries_total`` deltas, parsed with prometheus_client), requests per worker
(``/sim/stats`` ``received`` deltas), errors and, for router runs, the policy's own decision
counts from the router's ``/metrics``.

Session affinity phase (when ``session_affinity`` is selected and registered): sessions with
short prompts, 8 in flight; which worker served each request is learnt by polling every
worker's ``/sim/stats`` request log for the unique ``X-Request-Id`` sent with it. Halfway through,
the worker that is home to most sessions is drained (``POST /api/workers/{id}/drain``); the
check is that nothing fails, nothing reaches it once the router stops routing to it, and its
sessions settle elsewhere. It is then activated again.

With ``--kv`` (issue 15) the workers also publish KV cache events (registered with
``kv_events`` and a replay endpoint) and report ``usage.prompt_tokens_details.cached_tokens``;
every stream asks for its usage, so the router's cache check gives each run's prediction
accuracy; ``kv_aware`` can be selected; and the ``churn`` workload (``bench/routing/churn.py``)
restarts the busiest worker halfway through the ``prefix`` sessions (``--churn restart``, a
rolling restart: drain, stop and start, activate) or clears its cache (``--churn clear``).

Usage: ``.venv/bin/python -m bench.routing [--quick] [--kv] [--only-workload NAME]...
[--policies a,b,...] [--churn restart|clear]``. Prints a markdown report on stdout
(progress on stderr) and writes the figures to ``bench/out/routing-<timestamp>.json``. All
traffic stays on 127.0.0.1; every subprocess is stopped on exit, error or Ctrl-C.

This script runs the workloads mode by mode and round by round. Its parts: the fleet in
``bench/routing/fleet.py`` and its counters in ``bench/routing/readings.py``, the workloads and
the cache sizing in ``bench/routing/workloads.py``, the policies and baselines in
``bench/routing/modes.py``, the load generator and one measured run in
``bench/routing/load.py``, the session affinity phase in ``bench/routing/affinity.py``, the
report in ``bench/routing/report.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from functools import partial
from typing import Any

import aiohttp
import orjson

from bench.common.output import log, machine_info, write_json
from bench.common.wire import JSON_HEADERS
from bench.routing.affinity import affinity_phase, affinity_workload
from bench.routing.churn import CHURN, CLEAR, RESTART, Churn, churn_workload
from bench.routing.fleet import (
    BLOCK_SIZE,
    CELERY_RESTARTS,
    ITL_MS,
    MAX_BATCH,
    MAX_TOKENS,
    MODEL,
    N_WORKERS,
    PREFILL_MS_PER_BLOCK,
    TTFT_MS,
    Fleet,
    kv_streams,
    start_fleet,
)
from bench.routing.load import CONCURRENCY, Measured, RunResult, chat, run_one, summarize
from bench.routing.modes import (
    ALL_POLICIES,
    DIRECT_MODES,
    KNOWN_POLICIES,
    POLICY_CONFIGS,
    PolicySwitch,
    add_config_arguments,
)
from bench.routing.report import report
from bench.routing.workloads import (
    FULL,
    QUICK,
    SEED,
    WORKLOADS,
    Scale,
    Workload,
    build_workloads,
    session_words,
    sizing_lines,
    working_set,
)
from harness.fleet import PYTHON, ROOT, run_with_fleet
from harness.fleet import Fleet as ProcessFleet
from harness.tokenizer_folder import build_word_tokenizer_folder
from simulator.tokens import output_text

DEFAULT_ROUNDS = 3


# --------------------------------------------------------------------------- the benchmark


def all_workloads(scale: Scale, kv: bool, how: str = RESTART) -> dict[str, Workload]:
    """The seeded workloads; with --kv also `churn` (bench/routing/churn.py)."""
    workloads = build_workloads(scale, SEED)
    if kv:
        workloads[CHURN] = churn_workload(workloads["prefix"], how)
    return workloads


async def warm_up(http: aiohttp.ClientSession, fleet: Fleet) -> None:
    """A few short requests on every path, so no measured run pays for connection set-up."""
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2,
         "stream": True}
    )  # fmt: skip
    for base in [*fleet.workers, fleet.router, fleet.router]:
        result = await chat(http, base + "/v1/chat/completions", body, JSON_HEADERS)
        if not result.ok:
            raise RuntimeError(f"warm-up request to {base} failed: {result.error}")


def log_policy_api(switch: PolicySwitch) -> None:
    log(
        f"policy API: {'available' if switch.available else 'NOT available'}; registered: "
        f"{', '.join(switch.registered) if switch.registered is not None else 'unknown'}; "
        f"in force: {switch.current}"
    )


async def mode_ready(
    http: aiohttp.ClientSession, switch: PolicySwitch, mode: str, skipped: dict[str, str]
) -> bool:
    """Whether `mode` can run now; a policy the router refuses is skipped from then on."""
    if mode in skipped:
        return False
    if mode not in DIRECT_MODES:
        why = await switch.use(http, mode)
        if why is not None:
            skipped[mode] = why
            log(f"  {mode:<16} skipped: {why}")
            return False
    return True


def log_run(r: int, mode: str, one: RunResult) -> None:
    log(
        f"  r{r + 1} {mode:<16} TTFT mean {one.ttft_mean_ms:6.1f} p99 "
        f"{one.ttft_p99_ms:6.1f} ms (engine {one.engine_ttft_ms:5.1f}, queue "
        f"{one.queue_wait_ms:5.1f}) | {one.rps:6.1f} req/s | hit "
        f"{one.hit_rate:.3f} | per worker {one.per_worker} | errors "
        f"{one.errors} | {one.wall_s:.1f} s"
    )


async def run_workload(
    http: aiohttp.ClientSession,
    fleet: Fleet,
    switch: PolicySwitch,
    workload: Workload,
    args: argparse.Namespace,
    skipped: dict[str, str],
    details: list[dict[str, Any]],
) -> list[RunResult]:
    """Every mode on one workload, `args.rounds` times; each run's figures go to `details`."""
    name = workload.name
    log(f"workload {name}: {workload.requests} requests ({workload.description})")
    modes = [m for m in DIRECT_MODES if m not in args.skip_baseline] + args.policies
    measured: dict[str, list[Measured]] = {m: [] for m in modes}
    for r in range(args.rounds):
        k = r % len(modes)
        for mode in modes[k:] + modes[:k]:  # rotate the order from round to round
            if not await mode_ready(http, switch, mode, skipped):
                continue
            churn = Churn(http, fleet, workload, mode, args.churn) if name == CHURN else None
            hooks = churn.hooks() if churn is not None else None
            run = await run_one(http, fleet, workload, mode, f"{name}-{mode}-{r}", hooks)
            measured[mode].append(run)
            one = summarize(name, mode, [run])
            details.append({"round": r, **asdict(one)})
            log_run(r, mode, one)
    return [summarize(name, m, runs) for m, runs in measured.items() if runs]


async def run_affinity(
    http: aiohttp.ClientSession,
    fleet: Fleet,
    switch: PolicySwitch,
    scale: Scale,
    args: argparse.Namespace,
    skipped: dict[str, str],
) -> dict[str, Any] | None:
    """The session affinity phase, when session_affinity is selected and can be switched to."""
    if "session_affinity" not in args.policies or "session_affinity" in skipped:
        return None
    why = await switch.use(http, "session_affinity")
    if why is not None:
        skipped["session_affinity"] = why
        return None
    workload = affinity_workload(scale, SEED)
    log(f"session affinity phase: {workload.description}; drain halfway")
    affinity = await affinity_phase(http, fleet, workload)
    log(f"  {json.dumps(affinity, default=str)}")
    return affinity


async def benchmark(args: argparse.Namespace, proc: ProcessFleet) -> dict[str, Any]:
    scale = QUICK if args.quick else FULL
    workloads = all_workloads(scale, args.kv, args.churn)
    ws = working_set(workloads["prefix"])
    for line in sizing_lines(ws):
        log(line)
    kv = " publishing KV events" if args.kv else ""
    log(f"starting {N_WORKERS} simulated workers{kv} and the router ...")
    tokenizer = ""
    if args.tokenizer:
        words = {w for load in workloads.values() for s in load.sessions for w in session_words(s)}
        vocabulary = sorted(words | set(output_text(MAX_TOKENS).split()))
        tokenizer = str(build_word_tokenizer_folder(proc.tmp / "tokenizer", vocabulary))
        log(f"tokenizer folder {tokenizer}: one token per word, {len(vocabulary)} words")
    fleet = await start_fleet(
        proc, ws["cache_blocks_per_worker"], args.prefill_ms_per_block, kv=args.kv,
        tokenizer=tokenizer,
    )  # fmt: skip
    results: list[RunResult] = []
    details: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await warm_up(http, fleet)
        switch = PolicySwitch(fleet)
        await switch.probe(http)
        log_policy_api(switch)
        for name in [w for w in workloads if not args.only_workload or w in args.only_workload]:
            results += await run_workload(
                http, fleet, switch, workloads[name], args, skipped, details
            )
        affinity = await run_affinity(http, fleet, switch, scale, args, skipped)
        streams = await kv_streams(http, fleet.router) if args.kv else []
    return {
        "working_set": ws,
        "runs": [asdict(r) for r in results],
        "rounds_detail": details,
        "skipped": skipped,
        "policy_api_notes": switch.notes,
        "celery_restarts": CELERY_RESTARTS,
        "registered_policies": switch.registered,
        "affinity": affinity,
        "kv_streams": streams,
    }


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}",
        description="Compare the routing policies (and client-side baselines) on seeded workloads.",
    )
    parser.add_argument("--quick", action="store_true", help="smaller workloads: a smoke run")
    parser.add_argument(
        "--only-workload",
        choices=(*WORKLOADS, CHURN),
        action="append",
        help="run just this workload (repeatable; churn needs --kv)",
    )
    parser.add_argument(
        "--skip-baseline",
        choices=DIRECT_MODES,
        action="append",
        default=[],
        help="leave this baseline out (repeatable), e.g. client_rr when no target needs it",
    )
    parser.add_argument(
        "--kv",
        action="store_true",
        help="workers publish KV cache events (registered with kv_events and a replay "
        "endpoint) and report cached tokens (--enable-prompt-tokens-details); streams ask "
        "for usage; adds the churn workload; kv_aware can be selected",
    )
    parser.add_argument(
        "--churn",
        choices=(RESTART, CLEAR),
        default=RESTART,
        help="how the churn workload's busiest worker loses its cache halfway: restart (a "
        "rolling restart: drain, stop and start its process, activate) or clear (POST "
        "/reset_prefix_cache on the running process); default restart",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"runs per workload and mode, pooled (default {DEFAULT_ROUNDS}, 1 with --quick)",
    )
    parser.add_argument(
        "--policies",
        default=",".join(ALL_POLICIES),
        help=f"comma-separated router policies (default: {','.join(ALL_POLICIES)})",
    )
    parser.add_argument(
        "--prefill-ms-per-block",
        type=float,
        default=PREFILL_MS_PER_BLOCK,
        help=f"simulated prefill cost per uncached block (default {PREFILL_MS_PER_BLOCK:g})",
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--tokenizer",
        action="store_true",
        help="with --kv: a tokenizer folder trained here on the workload's words, loaded by "
        "the workers (--tokenizer) and the router (the model's tokenizer): kv_aware "
        "tokenizes locally instead of one /tokenize hop per request",
    )
    args = parser.parse_args(argv)
    if args.tokenizer and not args.kv:
        parser.error("--tokenizer needs --kv")
    if not 0 <= args.prefill_ms_per_block <= 100:
        parser.error("--prefill-ms-per-block must be between 0 and 100")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in KNOWN_POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; known: {', '.join(KNOWN_POLICIES)}")
    if CHURN in (args.only_workload or []) and not args.kv:
        parser.error("the churn workload needs --kv")
    args.policies = list(dict.fromkeys(policies))
    if args.rounds is None:
        args.rounds = 1 if args.quick else DEFAULT_ROUNDS
    if not 1 <= args.rounds <= 10:
        parser.error("--rounds must be between 1 and 10")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    POLICY_CONFIGS["prefix_aware"] = args.prefix_config
    POLICY_CONFIGS["kv_aware"] = args.kv_config
    started = time.monotonic()
    measured = run_with_fleet(partial(benchmark, args))
    if measured is None:
        return 130
    scale = QUICK if args.quick else FULL
    result = {
        "machine": machine_info(),
        "config": {
            "quick": args.quick,
            "only_workload": args.only_workload,
            "kv": args.kv,
            "skipped_baselines": args.skip_baseline,
            "rounds": args.rounds,
            "policies": args.policies,
            "scale": asdict(scale),
            "seed": SEED,
            "concurrency": CONCURRENCY,
            "max_tokens": MAX_TOKENS,
            "simulator": {
                "ttft_ms": TTFT_MS,
                "prefill_ms_per_block": args.prefill_ms_per_block,
                "itl_ms": ITL_MS,
                "max_batch": MAX_BATCH,
                "block_size": BLOCK_SIZE,
            },
            "python": PYTHON,
        },
        "workloads": {
            n: w.description for n, w in all_workloads(scale, args.kv, args.churn).items()
        },
        "duration_s": round(time.monotonic() - started, 1),
        **measured,
    }
    print(report(result))
    path = write_json("routing", result)
    log(f"\nwrote {path.relative_to(ROOT)} ({result['duration_s']} s)")
    errors = sum(r["errors"] for r in result["runs"])
    if result["affinity"] is not None:
        errors += result["affinity"]["errors"]
    if errors:
        log(f"WARNING: {errors} requests failed; the figures are suspect")
    return 1 if errors else 0
