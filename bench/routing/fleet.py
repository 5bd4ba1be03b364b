"""The processes of ``bench.routing``.

A library for that script, not a script: the simulated workers' timing and cache geometry
(:func:`start_sim`), the router, the Celery worker with beat and the floor proxy
(:func:`start_fleet`, :class:`Fleet`), the workers' KV event streams and the router's
tokenizer (:func:`wait_kv_ready`, :func:`use_tokenizer`), and the restart of a Celery worker
that died (:func:`revive_celery`). What is read from them (CPU, the workers' and the router's
counters) is in bench/routing/readings.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

import aiohttp
import orjson

from bench.common.floor import start_floor
from bench.common.output import log
from bench.common.router_api import http_ok, listed_workers, post_ok, register_workers
from bench.common.wire import JSON_HEADERS
from harness.fleet import HOST, PYTHON, start_router, wait_ready
from harness.fleet import Fleet as ProcessFleet
from harness.processes import free_ports

MODEL = "bench-routing"
N_WORKERS = 4

# Simulator timing and cache geometry (the cache size itself is derived from the workload).
TTFT_MS = 5.0
# Calibrated against the reference baselines, see bench.routing; the
# default of --prefill-ms-per-block, which start_fleet is given.
PREFILL_MS_PER_BLOCK = 6.0
ITL_MS = 2.0
MAX_BATCH = 8
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
MAX_TOKENS = 16  # every answer's length: the simulator's default and every request's
PROBE_INTERVAL_S = 1.0  # health probes / metrics scrapes (Celery beat); the default is 5 s

FLOOR_PIN = "/upstream/"  # bench/common/floor_proxy.py: /upstream/<i>/v1/... goes to upstream i


# --------------------------------------------------------------------------- fleet


@dataclass
class Fleet:
    proc: ProcessFleet
    router: str
    router_pid: int
    workers: list[str]  # base URLs, index = worker number
    worker_ids: list[int]  # router database ids, same order
    cache_blocks: int
    floor: str  # bench/common/floor_proxy.py, for floor_oracle
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
    fleet: ProcessFleet,
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


def start_celery(fleet: ProcessFleet) -> None:
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
    proc: ProcessFleet,
    cache_blocks: int,
    prefill_ms_per_block: float,
    kv: bool = False,
    tokenizer: str = "",
) -> Fleet:
    """The workers (publishing KV events with `kv`), the router, Celery and the floor. With
    `tokenizer` (a folder), workers and router tokenize with it (routing.prompt.tokenize's local
    path: no /tokenize hop)."""
    # One call: ports from separate calls can coincide (each is released before the next).
    every = free_ports(N_WORKERS + 1 + (2 * N_WORKERS if kv else 0))
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
    router_pid = start_router(proc, ports[0])
    start_celery(proc)
    router = f"http://{HOST}:{ports[0]}"
    workers = [f"http://{HOST}:{p}" for p in ports[1:]]
    floor_port = free_ports(1)[0]
    floor_pid = start_floor(proc, floor_port, {MODEL: workers})
    floor = f"http://{HOST}:{floor_port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in [*workers, router]:
            await wait_ready(f"{url}/health", partial(http_ok, session, url + "/health"), proc)
        ping = [{"role": "user", "content": "ping"}]
        probe = orjson.dumps({"model": MODEL, "messages": ping, "max_tokens": 1})
        url = f"{floor}{FLOOR_PIN}0/v1/chat/completions"
        await wait_ready(f"{floor} (floor)", partial(post_ok, session, url, probe), proc)
        endpoints = [kv_endpoints(p) for p in pairs]  # none without --kv
        extra = {
            u: {"kv_events": e, "kv_events_replay": r}
            for u, (e, r) in zip(workers, endpoints, strict=False)
        }
        await register_workers(session, proc, router, workers, extra=extra)
        if kv:
            await wait_kv_ready(session, proc, router, workers)
        if tokenizer:
            await use_tokenizer(session, proc, router, tokenizer)
        listed = await listed_workers(session, router)
    by_url = {w["url"].rstrip("/"): w["id"] for w in listed}
    ids = [by_url[u] for u in workers]
    return Fleet(proc, router, router_pid, workers, ids, cache_blocks, floor, floor_pid, endpoints)


async def use_tokenizer(
    session: aiohttp.ClientSession, proc: ProcessFleet, router: str, folder: str
) -> None:
    """Name the folder as the model's tokenizer and wait until the router has loaded it."""
    headers = {"Authorization": f"Bearer {proc.token}", **JSON_HEADERS}
    body = orjson.dumps({"tokenizer": folder})
    async with session.patch(f"{router}/api/models/{MODEL}", data=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"PATCH tokenizer: {r.status} {await r.text()}")
    await wait_tokenizer_loaded(session, proc, router, folder)


async def wait_tokenizer_loaded(
    session: aiohttp.ClientSession, proc: ProcessFleet, router: str, folder: str
) -> None:
    """Until the router (a process behind `router`) reports the folder loaded."""

    async def loaded() -> bool:
        async with session.get(f"{router}/health") as resp:
            state = orjson.loads(await resp.read()).get("tokenizers", {}).get(folder)
        if state not in (None, "loading", "loaded"):
            raise RuntimeError(f"the router cannot use {folder}: {state}")
        return bool(state == "loaded")

    await wait_ready(f"tokenizer {folder} loaded", loaded, proc, timeout=30)


async def wait_kv_ready(
    session: aiohttp.ClientSession, proc: ProcessFleet, router: str, workers: list[str]
) -> None:
    """Until `router` has a connected KV events stream from every worker, then (after a
    cache reset on each, whose AllBlocksCleared makes an index trusted) a trusted index."""

    async def streams() -> list[dict[str, Any]]:
        return [w.get("kv_events") or {} for w in await listed_workers(session, router)]

    async def connected() -> bool:
        return sum(1 for s in await streams() if s.get("connected")) >= len(workers)

    async def trusted() -> bool:
        ready = [s for s in await streams() if (s.get("index") or {}).get("trust") == "ready"]
        return len(ready) >= len(workers)

    await wait_ready(f"{router} KV events streams", connected, proc, timeout=30)
    for url in workers:
        async with session.post(url + "/reset_prefix_cache") as resp:
            await resp.read()
    await wait_ready(f"{router} KV indexes trusted", trusted, proc, timeout=30)


async def kv_streams(session: aiohttp.ClientSession, router: str) -> list[dict[str, Any]]:
    """Each worker's KV events stream and index as `router` shows them (for the report):
    events, gaps, replays, disconnects, malformed batches; index trust, restarts, clears."""
    listed = await listed_workers(session, router)
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
    for child in fleet.proc.procs:
        if child.name == "celery" and not child.alive():
            tail = fleet.proc.log_tail(child.name).strip().splitlines()
            why = tail[-1] if tail else "no log"
            code = child.proc.returncode
            CELERY_RESTARTS.append(f"{datetime.now(UTC):%H:%M:%S}: exit {code}, {why}")
            log(f"  celery exited ({why}); restarting it")
            fleet.proc.procs.remove(child)
            start_celery(fleet.proc)
            return
