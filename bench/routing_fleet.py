"""The processes of ``bench/routing_policies.py`` and what it reads from them.

A library for that script, not a script: the simulated workers' timing and cache geometry
(:func:`start_sim`), the router, the Celery worker with beat and the floor proxy
(:func:`start_fleet`, :class:`Fleet`), the restart of a Celery worker that died
(:func:`revive_celery`), the CPU counters read around a run (:class:`CpuMark`, by process
group, children included), and the counters read from the workers and the router: prefix-cache
queries and hits, requests received, the policies' decisions (:func:`read_fleet`,
:func:`router_decisions`), and the reset to cold caches before every run
(:func:`reset_workers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench import harness
from bench.harness import HOST, JSON_HEADERS, PYTHON, log

MODEL = "bench-routing"
N_WORKERS = 4

# Simulator timing and cache geometry (the cache size itself is derived from the workload).
TTFT_MS = 5.0
# Calibrated against the reference baselines, see bench/routing_policies.py; the
# default of --prefill-ms-per-block, which start_fleet is given.
PREFILL_MS_PER_BLOCK = 6.0
ITL_MS = 2.0
MAX_BATCH = 8
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
MAX_TOKENS = 16  # every answer's length: the simulator's default and every request's
PROBE_INTERVAL_S = 1.0  # health probes / metrics scrapes (Celery beat); the default is 5 s

FLOOR_PIN = "/upstream/"  # bench/floor_proxy.py: /upstream/<i>/v1/... goes to upstream i


# --------------------------------------------------------------------------- fleet


@dataclass
class Fleet:
    proc: harness.Fleet
    router: str
    router_pid: int
    workers: list[str]  # base URLs, index = worker number
    worker_ids: list[int]  # router database ids, same order
    cache_blocks: int
    floor: str  # bench/floor_proxy.py, for floor_oracle
    floor_pid: int
    # With --kv: each worker's (events, replay) endpoints, same order; empty without.
    kv_events: list[tuple[str, str]] = field(default_factory=list)


def kv_args(kv_ports: tuple[int, int] | None) -> list[str]:
    """The simulator flags of a worker that publishes KV events (with a replay socket) and
    reports usage.prompt_tokens_details.cached_tokens, as vLLM with --kv-events-config and
    --enable-prompt-tokens-details; none without `kv_ports`."""
    if kv_ports is None:
        return []
    return [
        "--kv-events-port", str(kv_ports[0]), "--kv-events-replay-port", str(kv_ports[1]),
        "--enable-prompt-tokens-details",
    ]  # fmt: skip


def kv_endpoints(kv_ports: tuple[int, int]) -> tuple[str, str]:
    return f"tcp://{HOST}:{kv_ports[0]}", f"tcp://{HOST}:{kv_ports[1]}"


def start_sim(
    fleet: harness.Fleet,
    name: str,
    port: int,
    cache_blocks: int,
    prefill_ms_per_block: float,
    kv_ports: tuple[int, int] | None = None,
    tokenizer: str = "",
) -> None:
    fleet.spawn(
        name,
        [
            PYTHON, "-m", "simulator", "--host", HOST, "--port", str(port),
            "--model", MODEL, "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS),
            "--prefill-ms-per-block", str(prefill_ms_per_block),
            "--max-batch", str(MAX_BATCH), "--cache-blocks", str(cache_blocks),
            "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            "--default-max-tokens", str(MAX_TOKENS), *kv_args(kv_ports),
            *(["--tokenizer", tokenizer] if tokenizer else []),
        ],
    )  # fmt: skip


def start_celery(fleet: harness.Fleet) -> None:
    """Celery worker with beat, as `manage.py serve` runs it: the health probes that scrape
    the workers' /metrics (least_kv's input) and the housekeeping that finishes drains."""
    fleet.spawn(
        "celery",
        [
            PYTHON, "-m", "celery", "-A", "controlpanel", "worker", "--beat",
            "--pool", "threads", "--concurrency", "4", "--loglevel", "WARNING",
        ],
    )  # fmt: skip


async def start_fleet(
    proc: harness.Fleet,
    cache_blocks: int,
    prefill_ms_per_block: float,
    kv: bool = False,
    tokenizer: str = "",
) -> Fleet:
    """The workers (publishing KV events with `kv`), the router, Celery and the floor. With
    `tokenizer` (a folder), workers and router tokenize with it (routing.tokenize's local
    path: no /tokenize hop)."""
    # One call: ports from separate calls can coincide (each is released before the next).
    every = harness.free_ports(N_WORKERS + 1 + (2 * N_WORKERS if kv else 0))
    ports, kv_ports = every[: N_WORKERS + 1], every[N_WORKERS + 1 :]
    pairs = [(kv_ports[2 * i], kv_ports[2 * i + 1]) for i in range(N_WORKERS)] if kv else []
    for i, port in enumerate(ports[1:]):
        start_sim(
            proc, f"worker{i}", port, cache_blocks, prefill_ms_per_block,
            pairs[i] if kv else None, tokenizer,
        )  # fmt: skip
    proc.env.update(
        CONTROLPANEL_PROBE_INTERVAL=str(PROBE_INTERVAL_S),
        CONTROLPANEL_HOUSEKEEPING_SECONDS=str(PROBE_INTERVAL_S),
    )
    router_pid = harness.start_router(proc, ports[0])
    start_celery(proc)
    router = f"http://{HOST}:{ports[0]}"
    workers = [f"http://{HOST}:{p}" for p in ports[1:]]
    floor_port = harness.free_ports(1)[0]
    floor_pid = harness.start_floor(proc, floor_port, {MODEL: workers})
    floor = f"http://{HOST}:{floor_port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in [*workers, router]:
            await harness.wait_until(
                f"{url}/health", partial(harness.http_ok, session, url + "/health"), proc
            )
        ping = [{"role": "user", "content": "ping"}]
        probe = orjson.dumps({"model": MODEL, "messages": ping, "max_tokens": 1})
        url = f"{floor}{FLOOR_PIN}0/v1/chat/completions"
        await harness.wait_until(
            f"{floor} (floor)", partial(harness.post_ok, session, url, probe), proc
        )
        endpoints = [kv_endpoints(p) for p in pairs]  # none without --kv
        extra = {
            u: {"kv_events": e, "kv_events_replay": r}
            for u, (e, r) in zip(workers, endpoints, strict=False)
        }
        await harness.register_workers(session, proc, router, workers, extra=extra)
        if kv:
            await wait_kv_ready(session, proc, router, workers)
        if tokenizer:
            await use_tokenizer(session, proc, router, tokenizer)
        listed = await harness.listed_workers(session, router)
    by_url = {w["url"].rstrip("/"): w["id"] for w in listed}
    ids = [by_url[u] for u in workers]
    return Fleet(proc, router, router_pid, workers, ids, cache_blocks, floor, floor_pid, endpoints)


async def use_tokenizer(
    session: aiohttp.ClientSession, proc: harness.Fleet, router: str, folder: str
) -> None:
    """Name the folder as the model's tokenizer and wait until the router has loaded it."""
    headers = {"Authorization": f"Bearer {proc.token}", **JSON_HEADERS}
    body = orjson.dumps({"tokenizer": folder})
    async with session.patch(f"{router}/api/models/{MODEL}", data=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"PATCH tokenizer: {r.status} {await r.text()}")
    await wait_tokenizer_loaded(session, proc, router, folder)


async def wait_tokenizer_loaded(
    session: aiohttp.ClientSession, proc: harness.Fleet, router: str, folder: str
) -> None:
    """Until the router (a process behind `router`) reports the folder loaded."""

    async def loaded() -> bool:
        async with session.get(f"{router}/health") as resp:
            state = orjson.loads(await resp.read()).get("tokenizers", {}).get(folder)
        if state not in (None, "loading", "loaded"):
            raise RuntimeError(f"the router cannot use {folder}: {state}")
        return state == "loaded"

    await harness.wait_until(f"tokenizer {folder} loaded", loaded, proc, timeout=30)


async def wait_kv_ready(
    session: aiohttp.ClientSession, proc: harness.Fleet, router: str, workers: list[str]
) -> None:
    """Until `router` has a connected KV events stream from every worker, then (after a
    cache reset on each, whose AllBlocksCleared makes an index trusted) a trusted index."""

    async def streams() -> list[dict[str, Any]]:
        return [w.get("kv_events") or {} for w in await harness.listed_workers(session, router)]

    async def connected() -> bool:
        return sum(1 for s in await streams() if s.get("connected")) >= len(workers)

    async def trusted() -> bool:
        ready = [s for s in await streams() if (s.get("index") or {}).get("trust") == "ready"]
        return len(ready) >= len(workers)

    await harness.wait_until(f"{router} KV events streams", connected, proc, timeout=30)
    for url in workers:
        async with session.post(url + "/reset_prefix_cache") as resp:
            await resp.read()
    await harness.wait_until(f"{router} KV indexes trusted", trusted, proc, timeout=30)


async def kv_streams(session: aiohttp.ClientSession, router: str) -> list[dict[str, Any]]:
    """Each worker's KV events stream and index as `router` shows them (for the report):
    events, gaps, replays, disconnects, malformed batches; index trust, restarts, clears."""
    listed = await harness.listed_workers(session, router)
    out = []
    for w in listed:
        s = w.get("kv_events") or {}
        index = s.get("index") or {}
        out.append(
            {
                "worker": w["url"],
                **{k: s.get(k) for k in ("connected", "events", "batches", "gaps", "replays",
                                         "malformed", "disconnects")},
                **{f"index_{k}": index.get(k) for k in ("trust", "blocks", "restarts", "clears")},
            }
        )  # fmt: skip
    return out


# --------------------------------------------------------------------------- CPU readings


def descendants(roots: list[int]) -> list[int]:
    """The given pids and every process below them (Celery's beat runs as a child)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
        except OSError:
            continue
        ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):  # it exited meanwhile
            total += sum(harness.cpu_times(pid))
    return total


@dataclass(frozen=True)
class CpuMark:
    """CPU counters around a run: the proxy's, this benchmark's by process group (load
    generator, workers, router, floor, celery), the machine's."""

    router: float
    groups: dict[str, float]
    busy: int
    total: int

    @classmethod
    def take(cls, fleet: Fleet, proxy_pid: int) -> CpuMark:
        """`router` is the CPU of `proxy_pid`: the router, or the floor proxy."""
        groups = {"load generator": time.process_time()}
        for name, proc in fleet.proc.procs:
            group = "workers" if name.startswith("worker") else name
            groups[group] = groups.get(group, 0.0) + cpu_seconds(descendants([proc.pid]))
        busy, total = harness.machine_ticks()
        return cls(cpu_seconds([proxy_pid]), groups, busy, total)


def cpu_figures(before: CpuMark, after: CpuMark) -> tuple[float, float, float, dict[str, float]]:
    """(router CPU seconds, machine busy %, busy % of processes not in this benchmark, CPU
    seconds by process group)."""
    ticks = max(after.total - before.total, 1)
    busy_s = (after.busy - before.busy) / harness.CLK_TCK
    groups = {k: v - before.groups.get(k, 0.0) for k, v in after.groups.items()}
    other = 100 * (busy_s - sum(groups.values())) * harness.CLK_TCK / ticks
    busy_pct = 100 * (after.busy - before.busy) / ticks
    return after.router - before.router, busy_pct, max(0.0, other), groups


# --------------------------------------------------------------------------- worker counters


# Sums read from a worker's /metrics page: prefix-cache tokens, and the engine's own
# queue wait and time to first token (sum and count), which split a mode's client-side TTFT
# into the wait for a batch slot (where the routing put it), the engine's prefill (what the
# cache saved) and the hop (what is left: proxy, load generator, the machine's contention).
ENGINE_SUMS = {
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:request_queue_time_seconds_sum": "queue_s",
    "vllm:request_queue_time_seconds_count": "queued",
    "vllm:time_to_first_token_seconds_sum": "engine_ttft_s",
    "vllm:time_to_first_token_seconds_count": "engine_firsts",
}


def engine_sums(text: str) -> dict[str, float]:
    """ENGINE_SUMS' keys -> their sum over the page's samples (0 when absent)."""
    out = dict.fromkeys(ENGINE_SUMS.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = ENGINE_SUMS.get(sample.name)
            if key is not None:
                out[key] += sample.value
    return out


def policy_decisions(text: str) -> dict[tuple[str, str], float]:
    """(policy, decision) -> count for MODEL, from the router's /metrics page."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("controlpanel_router_policy_decisions"):
            continue
        for sample in family.samples:
            if sample.labels.get("model") == MODEL and not sample.name.endswith("_created"):
                key = (sample.labels.get("policy", "?"), sample.labels.get("decision", "?"))
                out[key] = out.get(key, 0.0) + sample.value
    return out


CACHE_CHECK = {  # the router's cache-check samples (routing/cache_check.py) -> our keys
    "controlpanel_router_cache_prediction_error_tokens_count": "checked",
    "controlpanel_router_cache_predictions_within_block_total": "within_block",
    "controlpanel_router_cache_predicted_tokens_total": "predicted",
    "controlpanel_router_cache_reported_tokens_total": "reported",
    "controlpanel_router_cache_predictions_unchecked_total": "unchecked",
    "controlpanel_router_kv_aware_fallbacks_total": "fallbacks",
}


CACHE_CHECK_PREFIXES = ("controlpanel_router_cache", "controlpanel_router_kv_aware")


def cache_checks(text: str) -> dict[str, dict[str, float]]:
    """policy -> the router's cache-check counters for MODEL (predictions checked, within one
    block, predicted and reported token sums, unchecked; kv_aware's fallbacks)."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(CACHE_CHECK_PREFIXES):
            continue
        for sample in family.samples:
            key = CACHE_CHECK.get(sample.name)
            if key is None or sample.labels.get("model") != MODEL:
                continue
            policy = sample.labels.get("policy", "kv_aware")
            tally = out.setdefault(policy, {})
            tally[key] = tally.get(key, 0.0) + sample.value
    return out


async def router_cache_checks(
    session: aiohttp.ClientSession, router: str
) -> dict[str, dict[str, float]]:
    async with session.get(router + "/metrics") as resp:
        return cache_checks(await resp.text())


def check_delta(
    after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """after - before, per policy and counter; policies with no change are left out."""
    out = {}
    for policy, tally in after.items():
        old = before.get(policy, {})
        delta = {k: v - old.get(k, 0.0) for k, v in tally.items()}
        if any(delta.values()):
            out[policy] = delta
    return out


@dataclass(frozen=True)
class WorkerReading:
    queries: float
    hits: float
    received: int
    running: int
    waiting: int
    queue_s: float = 0.0
    queued: float = 0.0
    engine_ttft_s: float = 0.0
    engine_firsts: float = 0.0


async def read_worker(session: aiohttp.ClientSession, url: str) -> WorkerReading:
    async with session.get(url + "/metrics") as resp:
        sums = engine_sums(await resp.text())
    async with session.get(url + "/sim/stats") as resp:
        stats = orjson.loads(await resp.read())
    return WorkerReading(
        received=stats["received"], running=stats["running"], waiting=stats["waiting"], **sums
    )


Sums = tuple[float, float]  # (seconds summed, requests counted)


def engine_sums_between(
    after: list[WorkerReading], before: list[WorkerReading]
) -> tuple[Sums, Sums]:
    """Over the requests between two readings of the fleet: the engines' queue wait and
    their TTFT, each as (seconds summed, requests)."""
    pairs = list(zip(after, before, strict=True))
    queue = (
        sum(a.queue_s - b.queue_s for a, b in pairs),
        sum(a.queued - b.queued for a, b in pairs),
    )
    ttft = (
        sum(a.engine_ttft_s - b.engine_ttft_s for a, b in pairs),
        sum(a.engine_firsts - b.engine_firsts for a, b in pairs),
    )
    return queue, ttft


def mean_ms(sums: Sums) -> float:
    seconds, n = sums
    return 1000 * seconds / n if n else math.nan


def engine_means_ms(after: list[WorkerReading], before: list[WorkerReading]) -> tuple[float, float]:
    """(mean queue wait, mean engine TTFT) in ms over the requests between two readings."""
    queue, ttft = engine_sums_between(after, before)
    return mean_ms(queue), mean_ms(ttft)


async def read_fleet(session: aiohttp.ClientSession, fleet: Fleet) -> list[WorkerReading]:
    return list(await asyncio.gather(*(read_worker(session, u) for u in fleet.workers)))


async def reset_workers(session: aiohttp.ClientSession, fleet: Fleet) -> None:
    """Cold caches and zeroed counters on every worker; waits until nothing is running."""
    deadline = time.monotonic() + 30
    while True:
        readings = await read_fleet(session, fleet)
        if all(r.running == 0 and r.waiting == 0 for r in readings):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("workers still busy 30 s after a run")
        await asyncio.sleep(0.1)
    for url in fleet.workers:
        async with session.post(url + "/sim/reset") as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"POST {url}/sim/reset: HTTP {resp.status}")


async def router_decisions(
    session: aiohttp.ClientSession, fleet: Fleet
) -> dict[tuple[str, str], float]:
    async with session.get(fleet.router + "/metrics") as resp:
        return policy_decisions(await resp.text())


# --------------------------------------------------------------------------- policies


def admin_headers(fleet: Fleet) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.proc.token}", **JSON_HEADERS}


CELERY_RESTARTS: list[str] = []  # when and why, for the report


def revive_celery(fleet: Fleet) -> None:
    """Restart the Celery worker if it died. Under heavy CPU load kombu's filesystem broker
    (the embedded default) has been seen to crash it, reading a message file that was not
    written out yet (JSONDecodeError in kombu/transport/filesystem.py); the runs only need
    its probes and drain housekeeping, so one lost worker should not lose the benchmark.
    Restarts are listed in the report."""
    procs = fleet.proc.procs
    for i, (name, proc) in enumerate(procs):
        if name == "celery" and proc.poll() is not None:
            tail = fleet.proc.log_tail(name).strip().splitlines()
            why = tail[-1] if tail else "no log"
            CELERY_RESTARTS.append(f"{datetime.now(UTC):%H:%M:%S}: exit {proc.returncode}, {why}")
            log(f"  celery exited ({why}); restarting it")
            del procs[i]
            start_celery(fleet.proc)
            return
