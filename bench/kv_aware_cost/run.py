"""What does kv_aware's decision cost on a 4k-word prompt, and, apart, its tokenization?

In process, no subprocesses. A tokenizer is trained here with the `tokenizers` library (BPE,
vocabulary 2,000, over the bench's own word list) and saved as a Hugging Face folder with a
chat template, then loaded back by routing.prompt.tokenize.LocalTokenizer, as a router loads a
served model's ``tokenizer`` folder. The prompt: one user message of 4,000 words drawn from
400 words, rendered by the template and encoded.

Cases (the same token ids each call; `select` with the router's loads, 0-4 per worker):

* ``kv_aware, exact``: N workers, every one with a trusted exact index (routing.kv.kv_index) in
  which worker i holds the first i/N of the prompt's blocks (worker 0 none); one walk of
  the prompt's chain serves all workers, hashing as far as worker N-1's prefix.
* ``kv_aware, one unknown``: the same with worker N-1's index untrusted, so that worker is
  scored on prefix_aware's approximate index (the prompt's text chained too).
* ``kv_aware, exact, another request's credit to compare``: the first case after another
  request with the same prompt was routed and its answer has not started, so its pending
  credit (routing.policies.kv_pending) is compared on every call: a burst's cost. (Each
  timed call credits the worker too, replacing its own credit of the call before, which a
  request never counts for itself.)
* ``prefix_aware`` on the same prompt's text, for comparison (its tree pre-filled likewise).
* ``tokenize (chat, local, whole)``: LocalTokenizer.chat of the request: template render +
  encode of the whole prompt (a prompt seen for the first time; tokenizers whose pieces
  cannot be encoded apart, routing.prompt.tokenize_segments).
* ``tokenize (chat, local pieces, a new last message)``: the same conversation with a new
  60-word user message each call, as the router's path encodes a chat: render, cut at the
  special tokens, the 4,000-word message from the piece cache, only the new one encoded.
* ``tokenize (worker /tokenize hop)``: the same request through RequestTokens.of for a model
  without a folder, i.e. one POST /tokenize to a simulated vLLM server (``python -m
  simulator`` in its own process, which tokenizes one token per word) over a long-lived
  aiohttp session on 127.0.0.1: a floor for the hop (no network, an engine that tokenizes
  fast), the router's side and the worker's together.

Method: warm-up of 200 calls, then REPEATS repetitions of CALLS calls, each call timed on its
own with perf_counter_ns; the p50 and p99 of each repetition, and the median over
repetitions is printed. The garbage collector stays on, as in the router.

Usage: ``.venv/bin/python -m bench.kv_aware_cost [--workers N] [--quick]``. Prints a markdown
table and the machine on stdout; the figures go to ``bench/out/kv-aware-cost-<ts>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from bench.common.output import machine_info, write_json
from bench.common.workers import worker_view
from harness.processes import free_ports
from harness.tokenizer_folder import build_tokenizer_folder
from routing.fleet.snapshot import ModelRoute, WorkerView
from routing.kv.kv_index import KvIndex
from routing.policies.base import RequestInfo
from routing.policies.kv_aware import KvAwarePolicy
from routing.policies.prefix_aware import PrefixAwarePolicy
from routing.prompt.tokenize import CHAT_PATH, LocalTokenizer, RequestTokens

WORDS = 4000
BLOCK = 16


def vocabulary(n: int = 400) -> list[str]:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(n)]


def fleet(n: int) -> tuple[WorkerView, ...]:
    return tuple(worker_view(i) for i in range(n))


def filled_index(ids: list[int], workers: int, unknown: int | None) -> KvIndex:
    """Worker i holds the first i/N of the prompt's full blocks (stored as vLLM does)."""
    index = KvIndex()
    blocks = len(ids) // BLOCK
    for w in range(workers):
        index.clear(w)
        index.check_sequence(w, 0)
        held = blocks * w // workers
        hashes = [hash(("vllm", w, i)) for i in range(held)]
        if held:
            index.store(w, hashes, None, ids[: held * BLOCK], BLOCK, None)
    if unknown is not None:
        index.check_sequence(unknown, 10)  # a gap: untrusted
    return index


def timed(call: Callable[[], object], calls: int, repeats: int) -> dict[str, float]:
    for _ in range(200):
        call()
    p50s, p99s = [], []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        gc.collect()
        samples = []
        for _ in range(calls):
            start = clock()
            call()
            samples.append(clock() - start)
        samples.sort()
        p50s.append(samples[len(samples) // 2] / 1000)
        p99s.append(samples[int(len(samples) * 0.99)] / 1000)
    return {"p50_us": statistics.median(p50s), "p99_us": statistics.median(p99s)}


def new_last_message(
    local: LocalTokenizer, body: dict[str, Any], words: list[str], rng: random.Random
) -> Callable[[], object]:
    """A call that tokenizes the conversation so far (cached) and a new 60-word message,
    another each call, as the router's path does (routing.prompt.tokenize_segments)."""
    asked = itertools.count()
    earlier = body["messages"]

    def call() -> list[int]:
        message = f"turn {next(asked)} " + " ".join(rng.choices(words, k=60))
        text = local.render({"messages": [*earlier, {"role": "user", "content": message}]})
        plan = local.pieces.plan(text or "")
        assert plan is not None, local.pieces.off
        return local.pieces.join(plan, local.encode_pieces(plan.missing))

    return call


async def hop_samples(body: dict[str, Any], calls: int, repeats: int) -> dict[str, float]:
    """RequestTokens.of against a simulated worker in its own process (see the docstring)."""
    (port,) = free_ports(1)
    command = [sys.executable, "-m", "simulator", "--port", str(port), "--model", "m"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    worker = replace(fleet(1)[0], url=url)
    route = ModelRoute("m", "kv_aware", {}, (worker,))
    tokens = RequestTokens()
    try:
        async with aiohttp.ClientSession() as session:
            await _wait_healthy(session, url)
            for _ in range(50):
                assert await tokens.of(session, CHAT_PATH, route, body, (worker,), {})
            p50s, p99s = [], []
            for _ in range(repeats):
                samples = []
                for _ in range(calls):
                    start = time.perf_counter_ns()
                    await tokens.of(session, CHAT_PATH, route, body, (worker,), {})
                    samples.append(time.perf_counter_ns() - start)
                samples.sort()
                p50s.append(samples[len(samples) // 2] / 1000)
                p99s.append(samples[int(len(samples) * 0.99)] / 1000)
    finally:
        proc.terminate()
        proc.wait(10)
        tokens.close()
    return {"p50_us": statistics.median(p50s), "p99_us": statistics.median(p99s)}


async def _wait_healthy(session: aiohttp.ClientSession, url: str) -> None:
    for _ in range(200):
        try:
            async with session.get(url + "/health") as answer:
                if answer.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the simulator at {url} did not start")


def run(workers: int, calls: int, repeats: int) -> dict[str, Any]:
    words = vocabulary()
    rng = random.Random(2)
    prompt = " ".join(rng.choices(words, k=WORDS))
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
    with tempfile.TemporaryDirectory() as tmp:
        local = LocalTokenizer(str(build_tokenizer_folder(Path(tmp), words)))
    ids = local.chat(body)
    assert ids is not None
    fleet_ = fleet(workers)
    loads = {w.id: rng.randint(0, 4) for w in fleet_}
    results: dict[str, Any] = {"prompt_words": WORDS, "prompt_tokens": len(ids)}
    request = RequestInfo("m", body, (), tokens=ids)
    cases = (("kv_aware, exact", None, False), ("kv_aware, one unknown", workers - 1, False),
             ("kv_aware, exact, another request's credit to compare", None, True))  # fmt: skip
    for case, unknown, credited in cases:
        policy = KvAwarePolicy()
        policy.kv_index = filled_index(ids, workers, unknown)
        if credited:  # the same prompt routed just before, its answer not started yet
            policy.select(fleet_, RequestInfo("m", body, (), tokens=ids), loads)
        results[case] = timed(partial(policy.select, fleet_, request, loads), calls, repeats)
    prefix = PrefixAwarePolicy()
    text_request = RequestInfo("m", body, (), text=prompt)
    for w in range(workers):
        prefix.insert(w, prompt[: len(prompt) * w // workers])
    results["prefix_aware"] = timed(
        lambda: prefix.select(fleet_, text_request, loads), calls, repeats
    )
    results["tokenize (chat, local, whole)"] = timed(
        lambda: local.chat(body), max(calls // 10, 50), repeats
    )
    results["tokenize (chat, local pieces, a new last message)"] = timed(
        new_last_message(local, body, words, rng), max(calls // 10, 50), repeats
    )
    hop = asyncio.run(hop_samples(body, max(calls // 10, 50), repeats))
    results["tokenize (worker /tokenize hop)"] = hop
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="3 x 500 calls")
    args = parser.parse_args(argv)
    calls, repeats = (500, 3) if args.quick else (2000, 7)
    figures = run(args.workers, calls, repeats)
    meta = machine_info()
    path = write_json("kv-aware-cost", {"machine": meta, "workers": args.workers, **figures})
    head = f"kv_aware decision cost, {args.workers} workers, a {WORDS}-word prompt"
    tokens = figures["prompt_tokens"]
    print(f"{head} ({tokens} tokens); median of {repeats} x {calls} calls\n")
    print("| case | p50 µs | p99 µs |\n|---|---:|---:|")
    for case, value in figures.items():
        if isinstance(value, dict):
            print(f"| {case} | {value['p50_us']:.1f} | {value['p99_us']:.1f} |")
    machine = f"{meta['cpu_model']}, {meta['nproc']} cores, Python {meta['python']}"
    print("\nTarget: kv_aware p50 <= 100 µs, tokenization excluded (reported apart).")
    print(f"Machine: {machine}, kernel {meta['kernel']}, {meta['date']}.\nJSON: {path}")
    return 0
