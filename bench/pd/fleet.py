"""The processes of ``bench.pd``: one router (SQLite, no Celery: registration probes the
workers itself) and, for every set-up, its own simulated vLLM workers serving a model of its
own, registered with their roles, so one router serves every set-up and a run only sends to
its set-up's model. Every worker has the same timing, prefill interference on
(``simulator.engine``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import aiohttp

from bench.common.router_api import http_ok, register_workers
from harness.fleet import HOST, PYTHON, Fleet, start_router, wait_ready
from harness.processes import free_ports

# Timing of every simulated worker (ms). A long prompt of 4,500 tokens prefills in about
# 20 + 2 * 281 = 582 ms; while it does, every decode token on its engine takes
# 20 + 0.25 * 281 = 90 ms instead of 20 (a step carrying a prefill chunk is slower).
TTFT_MS = 20.0
PREFILL_MS_PER_BLOCK = 2.0
ITL_MS = 20.0
INTERFERENCE_MS_PER_BLOCK = 0.25
KV_TRANSFER_MS_PER_BLOCK = 0.5  # the simulator's default: a decode's pull of a long prompt
MAX_BATCH = 64  # no queueing: the runs compare step interference, not admission
BLOCK_SIZE = 16
CACHE_BLOCKS = 16_384
MAX_MODEL_LEN = 8192
DEFAULT_BYPASS = 256  # routing's default pd_bypass_tokens


@dataclass(frozen=True)
class Layout:
    """One set-up: its name (also its model's) and its workers' roles."""

    name: str
    roles: tuple[str, ...]

    @property
    def model(self) -> str:
        return f"pd-bench-{self.name}"

    @property
    def disaggregated(self) -> bool:
        return "prefill" in self.roles


COLOCATED = Layout("colocated", ("both",) * 4)
PD_2_2 = Layout("2p2d", ("prefill", "prefill", "decode", "decode"))
PD_1_3 = Layout("1p3d", ("prefill", "decode", "decode", "decode"))
LAYOUTS = (COLOCATED, PD_2_2, PD_1_3)


@dataclass
class Running:
    router: str
    workers: dict[str, list[str]]  # layout name -> worker URLs


def sim_args(port: int, model: str, role: str) -> list[str]:
    return [
        PYTHON, "-m", "simulator", "--host", HOST, "--port", str(port), "--model", model,
        "--role", role, "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS),
        "--prefill-ms-per-block", str(PREFILL_MS_PER_BLOCK),
        "--prefill-interference-ms-per-block", str(INTERFERENCE_MS_PER_BLOCK),
        "--kv-transfer-ms-per-block", str(KV_TRANSFER_MS_PER_BLOCK),
        "--max-batch", str(MAX_BATCH), "--cache-blocks", str(CACHE_BLOCKS),
        "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
    ]  # fmt: skip


async def start(proc: Fleet, layouts: list[Layout]) -> Running:
    """Every layout's workers and the router; returns when the router routes to all."""
    n = sum(len(layout.roles) for layout in layouts)
    ports = free_ports(n + 1)
    router_port, worker_ports = ports[0], iter(ports[1:])
    workers: dict[str, list[str]] = {}
    roles: dict[str, str] = {}
    for layout in layouts:
        for i, role in enumerate(layout.roles):
            port = next(worker_ports)
            proc.spawn(f"{layout.name}-{role}{i}", sim_args(port, layout.model, role))
            url = f"http://{HOST}:{port}"
            workers.setdefault(layout.name, []).append(url)
            roles[url] = role
    start_router(proc, router_port)
    router = f"http://{HOST}:{router_port}"
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for url in [*roles, router]:
            await wait_ready(f"{url}/health", partial(http_ok, session, url + "/health"), proc)
        extra = {u: {"role": r, "kv_events": ""} for u, r in roles.items()}
        await register_workers(session, proc, router, list(roles), extra=extra)
    return Running(router, workers)


async def set_bypass(
    session: aiohttp.ClientSession, proc: Fleet, router: str, model: str, tokens: int
) -> None:
    """PATCH /api/models/<model> {"pd_bypass_tokens": tokens} (0: every prompt is prefilled
    on a prefill worker)."""
    headers = {"Authorization": f"Bearer {proc.token}"}
    url = f"{router}/api/models/{model}"
    async with session.patch(url, json={"pd_bypass_tokens": tokens}, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"PATCH {url}: HTTP {r.status} {await r.text()}")


async def reset(session: aiohttp.ClientSession, urls: list[str]) -> None:
    """Cold prefix caches and zeroed counters on these workers (POST /sim/reset)."""
    for url in urls:
        async with session.post(f"{url}/sim/reset") as r:
            await r.read()
