"""The load generator of ``bench.routing``, and one measured run.

A library for that script, not a script: :func:`chat` (one streamed chat completion, its reply
and TTFT), :func:`run_sessions` (a workload's sessions all live at once, each session's turns
sequential, a bounded number of requests in flight), the client-side pickers of the baselines
(:func:`pickers`), :func:`run_one` (one workload in one mode from cold caches, with the worker,
router and CPU counters around it) and :func:`summarize` (runs pooled into a
:class:`RunResult`).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.common.output import percentile
from bench.common.wire import JSON_HEADERS
from bench.routing.fleet import FLOOR_PIN, MAX_TOKENS, MODEL, N_WORKERS, Fleet, revive_celery
from bench.routing.modes import BASELINES, DIRECT_MODES, FLOOR_MODES
from bench.routing.readings import (
    CpuMark,
    Sums,
    check_delta,
    cpu_figures,
    engine_sums_between,
    mean_ms,
    read_fleet,
    reset_workers,
    router_cache_checks,
    router_decisions,
)
from bench.routing.workloads import Session, Workload

CONCURRENCY = 32
REQUEST_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------- load generator


@dataclass
class Samples:
    ttfts: list[float] = field(default_factory=list)  # seconds
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    error_kinds: Counter[str] = field(default_factory=Counter)
    sent: int = 0

    def fail(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] += 1


@dataclass(frozen=True)
class Outcome:
    ok: bool
    reply: str
    ttft: float
    latency: float
    error: str = ""
    cached_tokens: int | None = None  # usage.prompt_tokens_details, when the stream had it
    prompt_tokens: int | None = None


def usage_tokens(obj: dict[str, Any]) -> tuple[int | None, int | None]:
    """(cached, prompt) tokens of a chunk's usage object, or Nones."""
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached, usage.get("prompt_tokens")


async def chat(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> Outcome:
    """One streamed chat completion; the reply text is the concatenated content deltas."""
    t0 = time.perf_counter()
    first = 0.0
    parts: list[str] = []
    done = False
    buf = b""
    cached = prompt = None
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            status = resp.status
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        done = True
                        continue
                    obj = orjson.loads(data)
                    if obj.get("usage"):
                        cached, prompt = usage_tokens(obj)
                    choices = obj.get("choices") or [{}]
                    content = (choices[0].get("delta") or {}).get("content")
                    if content:
                        if not first:
                            first = time.perf_counter()
                        parts.append(content)
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        return Outcome(False, "".join(parts), 0.0, 0.0, type(exc).__name__)
    latency = time.perf_counter() - t0
    if status != 200:
        return Outcome(False, "", 0.0, latency, f"HTTP {status}")
    if not first or not done:
        return Outcome(False, "".join(parts), 0.0, latency, "incomplete stream")
    return Outcome(True, "".join(parts), first - t0, latency, "", cached, prompt)


Picker = Callable[[Session], str]  # chooses the base URL for a session's next request


def request_body(
    session: Session, messages: list[dict[str, str]], include_usage: bool = False
) -> bytes:
    """The streamed chat completion; with `include_usage` the stream ends with its usage
    (stream_options.include_usage), which the router's cache check reads."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "user": session.key,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


async def run_sessions(
    workload: Workload,
    pick: Picker,
    concurrency: int,
    tag: str,
    on_request: Callable[[str, Session, int, float], None] | None = None,
    on_done: Callable[[str, Outcome], None] | None = None,
    think_s: float = 0.0,
    include_usage: bool = False,
    session_headers: Callable[[Session], dict[str, str]] | None = None,
) -> tuple[Samples, float]:
    """All sessions live at once, at most `concurrency` requests in flight; each session's
    turns are sequential (turn k+1 is sent `think_s` after turn k's answer is read to the
    end). A session's headers are `X-Session-ID: <key>`, or what `session_headers` gives
    (an agent's own session header, its client key)."""
    out = Samples()
    sem = asyncio.Semaphore(concurrency)
    counter = iter(range(10**9))
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def one_session(http: aiohttp.ClientSession, s: Session) -> None:
        messages: list[dict[str, str]] = []
        if s.system is not None:
            messages.append({"role": "system", "content": s.system})
        for k, turn in enumerate(s.turns):
            messages.append({"role": "user", "content": turn})
            body = request_body(s, messages, include_usage)
            async with sem:
                rid = f"{tag}-{next(counter)}"
                named = session_headers(s) if session_headers else {"X-Session-ID": s.key}
                headers = {**JSON_HEADERS, **named, "X-Request-Id": rid}
                base = pick(s)
                out.sent += 1
                if on_request is not None:
                    on_request(rid, s, k, time.monotonic())
                result = await chat(http, base + "/v1/chat/completions", body, headers)
            if on_done is not None:
                on_done(rid, result)
            if result.ok:
                out.ttfts.append(result.ttft)
                out.latencies.append(result.latency)
            else:
                out.fail(result.error)
            messages.append({"role": "assistant", "content": result.reply})
            if think_s and k + 1 < len(s.turns):
                await asyncio.sleep(think_s)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_session(http, s) for s in workload.sessions))
        wall = time.perf_counter() - t0
    return out, wall


# --------------------------------------------------------------------------- one run


@dataclass
class Measured:
    """The raw outcome of one run (one workload, one mode, one round)."""

    samples: Samples
    wall_s: float
    hits: float
    queries: float
    per_worker: list[int]
    decisions: dict[str, float]
    router_cpu_s: float
    machine_busy_pct: float
    other_busy_pct: float
    cpu_by_group_s: dict[str, float]
    # The router's cache-check counter deltas by policy (routing/telemetry/cache_check.py).
    checks: dict[str, dict[str, float]] = field(default_factory=dict)
    churn: dict[str, Any] | None = None  # bench/routing/churn.py's figures, on `churn`
    # Engine-side, from the workers' histograms: (seconds summed, requests) of the wait for
    # a batch slot, and of the engine's own time to first token (wait + prefill).
    queue: Sums = (0.0, 0.0)
    engine_ttft: Sums = (0.0, 0.0)


@dataclass
class RunResult:
    workload: str
    mode: str  # a policy name or a baseline
    kind: str  # "router", "client" or "floor"
    rounds: int
    requests: int
    ok: int
    errors: int
    error_kinds: dict[str, int]
    wall_s: float
    rps: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    hit_rate: float
    hit_tokens: float
    query_tokens: float
    per_worker: list[int]
    max_worker_share: float
    decisions: dict[str, float]
    policy_seen: list[str]
    router_cpu_ms_per_req: float
    machine_busy_pct: float  # mean over rounds
    other_busy_pct_max: float  # worst round
    cpu_ms_per_req: dict[str, float]  # by process group, over all rounds
    # The router's cache check of the mode's policy, pooled: checked, within_block, ...
    checks: dict[str, float] = field(default_factory=dict)
    accuracy: float = math.nan  # within one block / checked
    churn: list[dict[str, Any]] = field(default_factory=list)  # per round, on `churn`
    # Engine-side means, pooled: the wait for a batch slot, and wait + prefill. The client's
    # TTFT minus the engine's is the hop (proxy, load generator, the machine's contention).
    queue_wait_ms: float = math.nan
    engine_ttft_ms: float = math.nan


def summarize(workload: str, mode: str, runs: list[Measured]) -> RunResult:
    """Pooled over rounds: every TTFT sample, summed counters, throughput = all successful
    requests / all wall time."""
    ttft = [x * 1000 for m in runs for x in m.samples.ttfts]
    lat = [x * 1000 for m in runs for x in m.samples.latencies]
    wall = sum(m.wall_s for m in runs)
    hits = sum(m.hits for m in runs)
    queries = sum(m.queries for m in runs)
    per_worker = [sum(col) for col in zip(*(m.per_worker for m in runs), strict=True)]
    decisions: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    checks: Counter[str] = Counter()
    for m in runs:
        decisions.update(m.decisions)
        kinds.update(m.samples.error_kinds)
        checks.update(m.checks.get(mode.split("@", 1)[0], {}))
    return RunResult(
        workload=workload,
        mode=mode,
        kind="client" if mode in BASELINES else "floor" if mode in FLOOR_MODES else "router",
        rounds=len(runs),
        requests=sum(m.samples.sent for m in runs),
        ok=len(ttft),
        errors=sum(m.samples.errors for m in runs),
        error_kinds=dict(kinds),
        wall_s=wall,
        rps=len(ttft) / wall if wall else math.nan,
        ttft_mean_ms=statistics.fmean(ttft) if ttft else math.nan,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        latency_p50_ms=percentile(lat, 50),
        latency_p99_ms=percentile(lat, 99),
        hit_rate=hits / queries if queries else math.nan,
        hit_tokens=hits,
        query_tokens=queries,
        per_worker=per_worker,
        max_worker_share=max(per_worker) / max(sum(per_worker), 1),
        decisions=dict(decisions),
        policy_seen=sorted({k.split(":", 1)[0] for k in decisions}),
        router_cpu_ms_per_req=1000
        * sum(m.router_cpu_s for m in runs)
        / max(sum(m.samples.sent for m in runs), 1),
        machine_busy_pct=statistics.fmean(m.machine_busy_pct for m in runs),
        other_busy_pct_max=max(m.other_busy_pct for m in runs),
        cpu_ms_per_req={
            group: 1000
            * sum(m.cpu_by_group_s.get(group, 0.0) for m in runs)
            / max(sum(m.samples.sent for m in runs), 1)
            for group in runs[0].cpu_by_group_s
        },
        checks=dict(checks),
        accuracy=checks["within_block"] / checks["checked"] if checks["checked"] else math.nan,
        churn=[m.churn for m in runs if m.churn is not None],
        queue_wait_ms=_pooled_ms(m.queue for m in runs),
        engine_ttft_ms=_pooled_ms(m.engine_ttft for m in runs),
    )


def _pooled_ms(parts: Iterable[Sums]) -> float:
    """Seconds summed over requests counted, pooled, in ms."""
    listed = list(parts)
    return mean_ms((sum(s for s, _ in listed), sum(n for _, n in listed)))


def pickers(fleet: Fleet) -> dict[str, Picker]:
    rr = iter(range(10**9))
    return {
        "client_rr": lambda s: fleet.workers[next(rr) % N_WORKERS],
        "client_oracle": lambda s: fleet.workers[s.group % N_WORKERS],
        "floor_oracle": lambda s: f"{fleet.floor}{FLOOR_PIN}{s.group % N_WORKERS}",
    }


@dataclass
class Hooks:
    """What a run can add (bench/routing/churn.py): per-request callbacks for run_sessions,
    and a coroutine run beside the load whose result becomes Measured.churn."""

    on_request: Callable[[str, Session, int, float], None] | None = None
    on_done: Callable[[str, Outcome], None] | None = None
    beside: Callable[[], Awaitable[dict[str, Any]]] | None = None


async def run_one(
    http: aiohttp.ClientSession,
    fleet: Fleet,
    workload: Workload,
    mode: str,
    tag: str,
    hooks: Hooks | None = None,
) -> Measured:
    """One run from cold caches: reset, counters before, the workload, counters after."""
    hooks = hooks or Hooks()
    await reset_workers(http, fleet)
    router = mode not in DIRECT_MODES
    pick: Picker = (lambda s: fleet.router) if router else pickers(fleet)[mode]
    proxy_pid = fleet.floor_pid if mode in FLOOR_MODES else fleet.router_pid
    before = await read_fleet(http, fleet)
    decisions_before = await router_decisions(http, fleet) if router else {}
    revive_celery(fleet)
    fleet.proc.check_alive()
    checks_before = await router_cache_checks(http, fleet.router) if router else {}
    cpu_before = CpuMark.take(fleet, proxy_pid)
    load = run_sessions(
        workload, pick, CONCURRENCY, tag, hooks.on_request, hooks.on_done,
        include_usage=bool(fleet.kv_events),
    )  # fmt: skip
    churn = None
    if hooks.beside is None:
        samples, wall = await load
    else:
        (samples, wall), churn = await asyncio.gather(load, hooks.beside())
    cpu_after = CpuMark.take(fleet, proxy_pid)
    checks_after = await router_cache_checks(http, fleet.router) if router else {}
    router_cpu, machine_busy, other_busy, by_group = cpu_figures(cpu_before, cpu_after)
    after = await read_fleet(http, fleet)
    decisions_after = await router_decisions(http, fleet) if router else {}
    pairs = list(zip(after, before, strict=True))
    queue, engine_ttft = engine_sums_between(after, before)
    decisions = {
        f"{p}:{d}": v - decisions_before.get((p, d), 0.0)
        for (p, d), v in decisions_after.items()
        if v - decisions_before.get((p, d), 0.0) > 0
    }
    return Measured(
        samples=samples,
        wall_s=wall,
        hits=sum(a.hits - b.hits for a, b in pairs),
        queries=sum(a.queries - b.queries for a, b in pairs),
        per_worker=[a.received - b.received for a, b in pairs],
        decisions=decisions,
        router_cpu_s=router_cpu,
        machine_busy_pct=machine_busy,
        other_busy_pct=other_busy,
        cpu_by_group_s=by_group,
        checks=check_delta(checks_after, checks_before),
        churn=churn,
        queue=queue,
        engine_ttft=engine_ttft,
    )
