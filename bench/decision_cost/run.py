"""What does one routing decision cost? Every registered policy at 4, 100 and 1,000 workers.

One decision is what the router runs per request around the forward: ``policy.select`` plus
``on_request_start`` and ``on_request_complete`` (the bench calls the last two right after the
first; the router calls them around the upstream request). Each call is timed on its own with
``time.perf_counter_ns`` (the timer's own cost, a few tens of ns, is printed and included).

Set-up per fleet size: WorkerViews built directly, seeded: queue lengths 0-4, KV-cache usage
uniform in 0-1 with fresh metrics (age 2 s), weights 1-3, and a fixed in-flight dict of 0-8
requests per worker. The same worker tuple is passed on every call, as the router passes its
snapshot's tuple until the next snapshot swap, so per-snapshot indexing is paid in warm-up
(the load index's rebuild every 256 decisions, routing.policies.load_index, is in the
samples: about 1 in 256, so in neither the p50 nor the p99).

Cases: every name in ``routing.policies.POLICIES`` at run time, plus variants that take a
policy's slow path:

* ``session_affinity``: a pool of 1,000 recurring session keys (X-Session-ID), i.e. sessions
  that have been seen before; ``session_affinity (new key)``: a key never seen before on every
  call, which is not in the policy's cache, so its first workers are looked up on the ring.
* ``least_kv (fallback)``: every worker's metrics stale, so the least-loaded fallback runs;
  ``least_kv (fallback, all busy)``: the same with 1-8 requests in flight on every worker and
  no reported queue (a loaded vLLM fleet), where a scan ordered by queue length cannot stop
  early.
* ``prefix_aware`` (once registered in POLICIES): a 4,000-word prompt as ``RequestInfo.text``,
  one of 16 rotating prompts that share 1,000-word system prompts with the pre-fill. Before
  timing, its tree is filled to 10,000 entries with its ``insert(worker_id, text)`` (prompts of
  a system prompt + 50 words, credited to the workers in turn); a policy without ``insert``
  gets 10,000 distinct prompts through select/on_request_start/on_request_complete instead.
  ``prefix_aware (load guard 8 / 1.5)``: the same with the thresholds bench.routing
  gives it, which the seeded loads (0-12 per worker) sometimes exceed, so the load-guard path
  is timed too.

Method: warm-up (at least 2,000 calls, and every pooled request once), then 5 repetitions of
20,000 calls (fewer when a call is slow: a repetition is capped near 2 s, never under 1,000
calls); p50 and p99 per repetition, and the median of the repetitions is reported. ``--quick``:
3 repetitions of 2,000 calls. The garbage collector stays on (the router runs with it), and
runs before each repetition.

Targets, printed beside the figures: p50 <= 20 µs for the load policies, p50 <= 100 µs for
prefix_aware on a 4k-word prompt.

Usage: ``.venv/bin/python -m bench.decision_cost [--quick]``. Prints a markdown table on stdout
(progress on stderr) and writes the figures to ``bench/out/decision-cost-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import string
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench.common.output import OUT_DIR
from bench.common.workers import worker_view
from harness.fleet import ROOT
from routing.fleet.snapshot import ModelEntry, WorkerView
from routing.policies import POLICIES, make_policy
from routing.policies.base import BasePolicy, RequestInfo

SIZES = (4, 100, 1000)
LOAD_TARGET_US = 20.0
PREFIX_TARGET_US = 100.0
# bench.routing's prefix_aware thresholds: with 0-12 requests per worker here, the
# candidate is sometimes past them, so this variant also times the load-guard path.
PREFIX_GUARD = {"balance_abs_threshold": 8.0, "balance_rel_threshold": 1.5}
PROMPT_WORDS = 4000
PREFILL_PROMPTS = 10_000
PREFILL_ENTRIES = 10_000
SESSION_POOL = 1000
REP_BUDGET_NS = 2_000_000_000
MIN_CALLS = 1000


@dataclass
class Case:
    """One row of the table: a policy (or a variant of one) and how its requests look."""

    label: str
    policy: str
    target_us: float
    stale_metrics: bool = False
    busy: bool = False  # 1-8 in flight on every worker, no reported queue
    requests: Callable[[int], list[RequestInfo]] | None = None  # calls -> requests, per rep
    prefill: bool = False
    config: dict[str, float] = field(default_factory=dict)  # policy_config


@dataclass
class Result:
    label: str
    policy: str
    workers: int
    calls: int
    p50_us: float
    p99_us: float
    reps_p50_us: list[float] = field(default_factory=list)
    reps_p99_us: list[float] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)
    target_p50_us: float = 0.0
    prefilled_entries: int | None = None


# --- workload -----------------------------------------------------------------------------


def build_fleet(
    n: int, *, stale: bool, busy: bool = False
) -> tuple[tuple[WorkerView, ...], dict[int, int]]:
    rng = random.Random(n)
    workers = tuple(
        worker_view(
            i,
            state="healthy",
            source="bench",
            models=(ModelEntry("bench"),),
            url=f"http://127.0.0.1:{10000 + i}",
            queue_length=0 if busy else rng.randint(0, 4),
            weight=float(rng.randint(1, 3)),
            kv_cache_usage=rng.random(),
            metrics_age=60.0 if stale else 2.0,
        )
        for i in range(1, n + 1)
    )
    inflight = {w.id: rng.randint(1 if busy else 0, 8) for w in workers}
    return workers, inflight


def plain_requests(_calls: int) -> list[RequestInfo]:
    return [RequestInfo(model="bench", body={"model": "bench"}, raw_headers=())]


def session_request(key: str) -> RequestInfo:
    headers = ((b"content-type", b"application/json"), (b"x-session-id", key.encode()))
    return RequestInfo(model="bench", body={"model": "bench"}, raw_headers=headers, session=key)


def session_pool(_calls: int) -> list[RequestInfo]:
    return [session_request(f"session-{i:06d}") for i in range(SESSION_POOL)]


class NewKeys:
    """A key never used before on every call, across repetitions."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, calls: int) -> list[RequestInfo]:
        first, self.next = self.next, self.next + calls
        return [session_request(f"new-{i:09d}") for i in range(first, first + calls)]


class Prompts:
    """Seeded pseudo-English: 100 system prompts of 1,000 words; pre-fill prompts are a system
    prompt plus 50 words; measured prompts are a system prompt plus 3,000 words."""

    def __init__(self) -> None:
        rng = random.Random(42)
        letters = string.ascii_lowercase
        vocab = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(5000)]
        self.rng, self.vocab = rng, vocab
        self.systems = [self.words(1000) for _ in range(100)]

    def words(self, n: int) -> str:
        return " ".join(self.rng.choices(self.vocab, k=n))

    def prefill(self) -> Iterator[str]:
        for i in range(PREFILL_PROMPTS):
            yield f"{self.systems[i % 100]} {self.words(50)}"

    def measured(self) -> list[RequestInfo]:
        tail = PROMPT_WORDS - 1000
        texts = [f"{self.systems[i * 7 % 100]} {self.words(tail)}" for i in range(16)]
        return [prompt_request(text) for text in texts]


def prompt_request(text: str) -> RequestInfo:
    body = {"model": "bench", "messages": [{"role": "user", "content": text}]}
    return RequestInfo(model="bench", body=body, raw_headers=(), text=text)


def fixed(requests: list[RequestInfo]) -> Callable[[int], list[RequestInfo]]:
    return lambda _calls: requests


def cases(prompts: Prompts | None) -> list[Case]:
    """Every registered policy (as registered now), plus the slow-path variants."""
    result: list[Case] = []
    for name in POLICIES:
        if name == "prefix_aware":
            if prompts is not None:
                measured = fixed(prompts.measured())
                result.append(Case(name, name, PREFIX_TARGET_US, requests=measured, prefill=True))
                result.append(
                    Case(f"{name} (load guard 8 / 1.5)", name, PREFIX_TARGET_US,
                         requests=measured, prefill=True, config=PREFIX_GUARD)
                )  # fmt: skip
            continue
        if name == "session_affinity":
            result.append(Case(name, name, LOAD_TARGET_US, requests=session_pool))
            result.append(Case(f"{name} (new key)", name, LOAD_TARGET_US, requests=NewKeys()))
            continue
        result.append(Case(name, name, LOAD_TARGET_US))
        if name == "least_kv":
            result.append(Case(f"{name} (fallback)", name, LOAD_TARGET_US, stale_metrics=True))
            result.append(
                Case(f"{name} (fallback, all busy)", name, LOAD_TARGET_US, stale_metrics=True,
                     busy=True)
            )  # fmt: skip
    return result


def prefix_aware_available() -> bool:
    """prefix_aware is measured only once it is registered and its module imports."""
    if "prefix_aware" not in POLICIES:
        print(
            "note: prefix_aware is not registered in routing.policies.POLICIES: skipped",
            file=sys.stderr,
        )
        return False
    try:
        make_policy("prefix_aware")
    except (ImportError, AttributeError) as exc:
        print(
            f"note: prefix_aware is registered but does not load ({exc}): skipped", file=sys.stderr
        )
        return False
    return True


# --- measurement --------------------------------------------------------------------------


def timed_calls(
    policy: BasePolicy,
    workers: Sequence[WorkerView],
    requests: Sequence[RequestInfo],
    inflight: Mapping[int, int],
    calls: int,
) -> list[int]:
    """Nanoseconds per decision, one sample per call."""
    select, start, complete = policy.select, policy.on_request_start, policy.on_request_complete
    clock = time.perf_counter_ns
    samples = [0] * calls
    pool = len(requests)
    for i in range(calls):
        request = requests[i % pool]
        t0 = clock()
        worker = select(workers, request, inflight).worker
        if worker is not None:
            start(worker, request)
            complete(worker, request, True)
        samples[i] = clock() - t0
    return samples


def percentile(sorted_samples: Sequence[int], q: float) -> float:
    index = min(len(sorted_samples) - 1, int(q * len(sorted_samples)))
    return sorted_samples[index] / 1000.0


def prefill(policy: BasePolicy, workers: Sequence[WorkerView], prompts: Prompts) -> int | None:
    """Fill the policy's prompt memory before timing. With an `insert(worker_id, text)` and an
    `entries` count (prefix_aware has both), prompts are credited to the workers in turn until
    PREFILL_ENTRIES entries are held; otherwise PREFILL_PROMPTS prompts go through
    select/on_request_start/on_request_complete. Returns the entries held, when known."""
    insert = getattr(policy, "insert", None)
    if callable(insert) and isinstance(getattr(policy, "entries", None), int):
        for i, text in enumerate(prompts.prefill()):
            if getattr(policy, "entries", 0) >= PREFILL_ENTRIES:
                break
            insert(workers[i % len(workers)].id, text)
    else:
        requests = [prompt_request(text) for text in prompts.prefill()]
        timed_calls(policy, workers, requests, {}, len(requests))
    entries = getattr(policy, "entries", None)
    return entries if isinstance(entries, int) else None


def measure(case: Case, n: int, *, reps: int, calls: int, prompts: Prompts | None) -> Result:
    workers, inflight = build_fleet(n, stale=case.stale_metrics, busy=case.busy)
    policy = make_policy(case.policy, case.config)
    make_requests = case.requests or plain_requests
    entries = prefill(policy, workers, prompts) if case.prefill and prompts else None
    warm = make_requests(MIN_CALLS)
    warm_samples = timed_calls(policy, workers, warm, inflight, max(2 * MIN_CALLS, len(warm)))
    estimate = max(1, int(statistics.median(warm_samples)))
    per_rep = max(MIN_CALLS, min(calls, REP_BUDGET_NS // estimate))
    p50s: list[float] = []
    p99s: list[float] = []
    for _ in range(reps):
        requests = make_requests(per_rep)
        gc.collect()
        samples = sorted(timed_calls(policy, workers, requests, inflight, per_rep))
        p50s.append(percentile(samples, 0.50))
        p99s.append(percentile(samples, 0.99))
    return Result(
        label=case.label,
        policy=case.policy,
        workers=n,
        calls=per_rep,
        p50_us=statistics.median(p50s),
        p99_us=statistics.median(p99s),
        reps_p50_us=p50s,
        reps_p99_us=p99s,
        decisions=dict(policy.decisions),
        target_p50_us=case.target_us,
        prefilled_entries=entries,
    )


def timer_overhead_ns() -> float:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(100_000):
        t0 = clock()
        samples.append(clock() - t0)
    return statistics.median(samples)


# --- report -------------------------------------------------------------------------------


def markdown(results: list[Result], sizes: Sequence[int]) -> str:
    head = " | ".join(f"{n} workers p50 / p99 µs" for n in sizes)
    lines = [
        f"| policy | {head} | target p50 | result |",
        "|---|" + "--:|" * len(sizes) + "--:|:-:|",
    ]
    for label in dict.fromkeys(r.label for r in results):
        rows = {r.workers: r for r in results if r.label == label}
        target = next(iter(rows.values())).target_p50_us
        cells = " | ".join(
            f"{rows[n].p50_us:.1f} / {rows[n].p99_us:.1f}" if n in rows else "-" for n in sizes
        )
        misses = [n for n, r in rows.items() if r.p50_us > target]
        verdict = "PASS" if not misses else "FAIL at " + ", ".join(map(str, misses))
        lines.append(f"| {label} | {cells} | ≤ {target:g} µs | {verdict} |")
    return "\n".join(lines)


def write_json(results: list[Result], meta: dict[str, object]) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = OUT_DIR / f"decision-cost-{stamp}.json"
    payload = {**meta, "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--quick", action="store_true", help="3 reps of 2,000 calls")
    args = parser.parse_args(argv)
    reps, calls = (3, 2000) if args.quick else (5, 20_000)
    prompts = Prompts() if prefix_aware_available() else None
    results: list[Result] = []
    for case in cases(prompts):
        for n in SIZES:
            print(f"{case.label} at {n} workers ...", file=sys.stderr, flush=True)
            results.append(measure(case, n, reps=reps, calls=calls, prompts=prompts))
    overhead = timer_overhead_ns()
    meta: dict[str, object] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "quick": args.quick,
        "reps": reps,
        "calls_per_rep": calls,
        "timer_overhead_ns": overhead,
        "policies": list(POLICIES),
        "prefix_aware_measured": prompts is not None,
    }
    path = write_json(results, meta)
    print("## Routing decision cost (select + on_request_start + on_request_complete)\n")
    print(markdown(results, SIZES))
    print(
        f"\nMedian of {reps} repetitions of up to {calls:,} calls each (fewer when a call is "
        f"slow); timer overhead {overhead:.0f} ns per sample, included. "
        f"Python {meta['python']}, {meta['platform']}.\nJSON: {path.relative_to(ROOT)}"
    )
    if prompts is None:
        print("\nprefix_aware: not registered (or not loadable) yet, skipped.")
    filled = [
        f"{r.workers} workers {r.prefilled_entries:,}" for r in results if r.prefilled_entries
    ]
    if filled:
        print(f"\nprefix_aware tree entries after pre-fill: {'; '.join(filled)}.")
    return 0
