"""The processes of ``bench.real_vllm`` and what it reads from them.

A library for that script, not a script: the two real vLLM servers (:func:`start_servers`,
dev mode for ``POST /reset_prefix_cache``, KV events with replay, a small cache), the router's
set-up (:func:`setup_router`: workers registered with their KV events endpoints, one health
probe, trusted indexes), the modes (:func:`use_mode`: policy, ``policy_config`` and tokenizer
folder through the admin API), the cold start of every run (:func:`cold_caches`), and the
counters read around a run (:func:`read_counters`: vLLM's prefix-cache counters, the router's
decisions, cache checks, fallbacks, malformed KV messages and tokenize outcomes, its CPU).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.common.output import log
from bench.common.router_api import http_ok, listed_workers, register_workers
from bench.common.wire import JSON_HEADERS
from harness.fleet import HOST, PYTHON, Fleet, start_router, wait_ready
from harness.processes import free_ports
from harness.procfs import cpu_times
from harness.real_vllm import VllmServer, server_args

MODEL = "tiny"
BLOCK_SIZE = 32  # the CPU backend needs a multiple of 32 (its default is 128)
MAX_NUM_SEQS = 8  # server_args' --max-num-seqs
MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings; at most one server's cache
PATIENCE_S = 120.0  # conditions on a busy 2-core machine with real vLLM on it

# The load guard of both cache policies sized for these servers' batch (routing_modes' rule).
GUARD = {"balance_abs_threshold": MAX_NUM_SEQS, "balance_rel_threshold": 1.5}
MODES: dict[str, dict[str, Any]] = {
    # mode -> PATCH /api/models/{MODEL} body ("tokenizer": True means the model's folder)
    "round_robin": {"policy": "round_robin", "policy_config": {}, "tokenizer": False},
    "prefix_aware": {"policy": "prefix_aware", "policy_config": GUARD, "tokenizer": False},
    "kv_aware/worker": {
        "policy": "kv_aware",
        "policy_config": GUARD,
        "tokenizer": False,
    },
    "kv_aware/local": {
        "policy": "kv_aware",
        "policy_config": GUARD,
        "tokenizer": True,
    },
}


@dataclass
class Servers:
    servers: list[VllmServer]
    kv_events: list[tuple[str, str]]  # (events, replay) per server, same order
    start_s: float = 0.0

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def max_model_len(cache_blocks: int) -> int:
    """vLLM refuses to start unless its cache holds one request of max_model_len tokens (one
    of its blocks is the null block)."""
    return min(MAX_MODEL_LEN, (cache_blocks - 1) * BLOCK_SIZE)


def start_servers(python: Path, model: Path, cache_blocks: int, log_dir: Path) -> Servers:
    """Two servers of `model` as ``tiny``, started together (they share the wait)."""
    ports = free_ports(6)
    servers, endpoints = [], []
    for i in range(2):
        port, kv_port, replay_port = ports[3 * i : 3 * i + 3]
        args = server_args(
            model, MODEL, port, kv_port=kv_port, replay_port=replay_port,
            block_size=BLOCK_SIZE, max_model_len=max_model_len(cache_blocks),
            extra=["--num-gpu-blocks-override", str(cache_blocks)],
        )  # fmt: skip
        env = {"VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache
        servers.append(VllmServer(python, args, log_dir / f"vllm-{i}.log", env=env))
        endpoints.append((f"tcp://{HOST}:{kv_port}", f"tcp://{HOST}:{replay_port}"))
    started = time.monotonic()
    running = Servers(servers, endpoints)
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
    except BaseException:
        running.stop()
        raise
    running.start_s = time.monotonic() - started
    return running


# --------------------------------------------------------------------------- the router


def admin(fleet: Fleet) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.token}", **JSON_HEADERS}


async def setup_router(
    session: aiohttp.ClientSession, fleet: Fleet, servers: Servers
) -> tuple[str, int]:
    """The router on a throw-away database, both servers registered with their KV events
    endpoints and probed once (vllm:cache_config_info's block size, no Celery running
    beside the benchmark), their indexes trusted. Returns (router URL, router pid)."""
    port = free_ports(1)[0]
    # Each request's checked prediction is on its access-log line (routing.telemetry.cache_check).
    fleet.env["CONTROLPANEL_ACCESS_LOG_FILE"] = str(access_log_path(fleet))
    pid = start_router(fleet, port)
    router = f"http://{HOST}:{port}"
    await wait_ready("router /health", lambda: http_ok(session, router + "/health"), fleet)
    extra = {u: {"kv_events": e, "kv_events_replay": r} for u, (e, r) in
             zip(servers.urls, servers.kv_events, strict=True)}  # fmt: skip
    await register_workers(session, fleet, router, servers.urls, extra=extra)
    probe = "from controlpanel.fleet import health; health.workers_probe()"
    fleet.run([PYTHON, "manage.py", "shell", "-c", probe])
    await wait_indexes(session, fleet, router, len(servers.urls))
    return router, pid


def access_log_path(fleet: Fleet) -> Path:
    return fleet.tmp / "access.log"


class AccessTail:
    """The router's access-log lines written since the last read."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as log:
            log.seek(self.offset)
            raw = log.read()
        whole = raw[: raw.rfind(b"\n") + 1]  # a line being written waits for the next read
        self.offset += len(whole)
        return [orjson.loads(line) for line in whole.splitlines() if line.startswith(b"{")]


def count_mispredictions(lines: list[dict[str, Any]], tally: dict[str, int]) -> None:
    """Predictions more than a block off, by the decision that made them and their sign."""
    for entry in lines:
        cache = entry.get("cache")
        if not cache:
            continue
        error = cache["predicted"] - cache["reported"]
        if abs(error) > cache["block_size"]:
            key = f"{cache['decision']} {'over' if error > 0 else 'under'}"
            tally[key] = tally.get(key, 0) + 1


async def kv_streams(session: aiohttp.ClientSession, router: str) -> list[dict[str, Any]]:
    return [w.get("kv_events") or {} for w in await listed_workers(session, router)]


async def wait_indexes(
    session: aiohttp.ClientSession, fleet: Fleet, router: str, n: int, empty: bool = False
) -> None:
    """Until `n` streams are connected with a trusted index (and with `empty`, holding no
    block: the engines' AllBlocksCleared applied)."""

    async def ready() -> bool:
        good = 0
        for stream in await kv_streams(session, router):
            index = stream.get("index") or {}
            if stream.get("connected") and index.get("trust") == "ready":
                good += not empty or index.get("blocks") == 0
        return good >= n

    what = "KV indexes trusted" + (" and empty" if empty else "")
    await wait_ready(what, ready, fleet, timeout=PATIENCE_S)


async def generation(session: aiohttp.ClientSession, router: str) -> int:
    async with session.get(router + "/health") as resp:
        return int(orjson.loads(await resp.read()).get("snapshot_generation") or 0)


async def patch_model(
    session: aiohttp.ClientSession, fleet: Fleet, router: str, body: dict[str, Any]
) -> None:
    """PATCH the model, then wait until the router runs on a newer snapshot (plus 1 s)."""
    before = await generation(session, router)
    url = f"{router}/api/models/{MODEL}"
    async with session.patch(url, data=orjson.dumps(body), headers=admin(fleet)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"PATCH {body}: HTTP {resp.status} {await resp.text()}")

    async def newer() -> bool:
        return await generation(session, router) > before

    await wait_ready("the router's new snapshot", newer, fleet, timeout=30)
    await asyncio.sleep(1.0)


async def use_mode(
    session: aiohttp.ClientSession, fleet: Fleet, router: str, mode: str,
    previous: str | None, folder: Path,
) -> None:  # fmt: skip
    """Make `mode` the model's: a fresh policy instance (through round_robin when the previous
    run had the same policy), and the tokenizer folder set or cleared."""
    spec = MODES[mode]
    if previous is not None and MODES[previous]["policy"] == spec["policy"]:
        await patch_model(session, fleet, router, {"policy": "round_robin", "policy_config": {}})
    tokenizer = str(folder) if spec["tokenizer"] else ""
    await patch_model(session, fleet, router, {"tokenizer": tokenizer})
    if tokenizer:
        await wait_tokenizer(session, fleet, router, tokenizer)
    body = {"policy": spec["policy"], "policy_config": spec["policy_config"]}
    await patch_model(session, fleet, router, body)


async def wait_tokenizer(
    session: aiohttp.ClientSession, fleet: Fleet, router: str, folder: str
) -> None:
    async def loaded() -> bool:
        async with session.get(router + "/health") as resp:
            state: str | None = orjson.loads(await resp.read()).get("tokenizers", {}).get(folder)
        if state not in (None, "loading", "loaded"):
            raise RuntimeError(f"the router cannot use {folder}: {state}")
        return state == "loaded"

    await wait_ready(f"tokenizer {folder} loaded", loaded, fleet, timeout=60)


# --------------------------------------------------------------------------- cold caches


async def cold_caches(
    session: aiohttp.ClientSession, fleet: Fleet, router: str, servers: Servers
) -> float:
    """Idle engines, then POST /reset_prefix_cache on both (retried while it answers
    success: false), and the router's indexes emptied by their AllBlocksCleared (which an
    idle engine publishes only with its next step: see flush_events). Returns the seconds
    it took."""
    started = time.monotonic()
    for url in servers.urls:
        await wait_idle(session, fleet, url)
        deadline = time.monotonic() + PATIENCE_S
        while True:
            async with session.post(url + "/reset_prefix_cache") as resp:
                body = orjson.loads(await resp.read()) if resp.status == 200 else {}
            if body.get("success"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}/reset_prefix_cache: HTTP {resp.status} {body}")
            await asyncio.sleep(0.2)
        await flush_events(session, url)
    await wait_indexes(session, fleet, router, len(servers.urls), empty=True)
    return time.monotonic() - started


async def flush_events(session: aiohttp.ClientSession, url: str) -> None:
    """One step of the engine, so that it publishes the events it holds: vLLM sends KV events
    after a step, and an idle engine does not step, so the AllBlocksCleared of a reset would
    otherwise reach the routers only with the next run's first request. A one-token answer
    to a two-token prompt (less than a block: nothing stored), straight to the server."""
    body = {"model": MODEL, "prompt": "ok", "max_tokens": 1}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}/v1/completions: HTTP {resp.status} {await resp.text()}")


async def wait_idle(session: aiohttp.ClientSession, fleet: Fleet, url: str) -> None:
    async def idle() -> bool:
        async with session.get(url + "/metrics") as resp:
            page = await resp.text()
        busy = samples(page, ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        return sum(busy.values()) == 0

    await wait_ready(f"{url} idle", idle, fleet, timeout=PATIENCE_S)


# --------------------------------------------------------------------------- counters

Labels = tuple[tuple[str, str], ...]
ENGINE = {  # vLLM's counters, summed over both servers (prefix cache: current and older names)
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:gpu_prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:gpu_prefix_cache_hits_total": "hits",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:time_to_first_token_seconds_sum": "engine_ttft_s",
    "vllm:time_to_first_token_seconds_count": "engine_firsts",
}
ROUTER_FAMILIES = (
    "controlpanel_router_policy_decisions",
    "controlpanel_router_cache_",
    "controlpanel_router_kv_aware_fallbacks",
    "controlpanel_router_kv_events_malformed",
    "controlpanel_router_kv_events_gaps",
    "controlpanel_router_tokenize_requests",
)


def samples(page: str, prefixes: tuple[str, ...]) -> dict[tuple[str, Labels], float]:
    """(sample name, sorted labels) -> value for the samples whose name starts with one of
    `prefixes` (``_created`` samples left out)."""
    out: dict[tuple[str, Labels], float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name.startswith(prefixes) and not sample.name.endswith("_created"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@dataclass
class Counters:
    """One reading of everything a run is measured by."""

    engine: dict[str, float]  # ENGINE's values, summed over both servers
    router: dict[tuple[str, Labels], float]
    router_cpu_s: float
    at: float = field(default_factory=time.monotonic)


async def read_counters(
    session: aiohttp.ClientSession, router: str, router_pid: int, servers: Servers
) -> Counters:
    engine = dict.fromkeys(ENGINE.values(), 0.0)
    for url in servers.urls:
        async with session.get(url + "/metrics") as resp:
            page = await resp.text()
        for (name, _), value in samples(page, tuple(ENGINE)).items():
            if name in ENGINE:
                engine[ENGINE[name]] += value
    async with session.get(router + "/metrics") as resp:
        router_samples = samples(await resp.text(), ROUTER_FAMILIES)
    return Counters(engine, router_samples, sum(cpu_times(router_pid)))


def delta(after: Counters, before: Counters) -> dict[str, Any]:
    """The run's counters: vLLM's (ENGINE), router CPU seconds, and each router
    sample's increase as {name: [[labels], increase]} (zero increases left out)."""
    router: dict[str, list[Any]] = {}
    for key, value in after.router.items():
        change = value - before.router.get(key, 0.0)
        if change:
            name, labels = key
            router.setdefault(name, []).append([dict(labels), change])
    return {
        **{k: v - before.engine[k] for k, v in after.engine.items()},
        "router_cpu_s": after.router_cpu_s - before.router_cpu_s,
        "router": router,
    }


def log_progress(message: str) -> None:
    log(f"  {message}")
