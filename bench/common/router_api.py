"""The router's HTTP API as the benchmarks drive it: health checks, registering workers through
``POST /api/workers`` and waiting until it routes to all of them, ``GET /list_workers``."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from bench.common.output import log
from bench.common.wire import JSON_HEADERS
from harness.fleet import Fleet, wait_ready

REGISTER_ATTEMPTS = 3


async def http_ok(session: aiohttp.ClientSession, url: str) -> bool:
    async with session.get(url) as resp:
        await resp.read()
        return resp.status == 200


async def post_ok(session: aiohttp.ClientSession, url: str, body: bytes) -> bool:
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        await resp.read()
        return resp.status == 200


async def register_worker(
    session: aiohttp.ClientSession,
    fleet: Fleet,
    router: str,
    url: str,
    name: str = "router",
    extra: dict[str, Any] | None = None,
) -> None:
    """POST /api/workers; a 5xx is retried (a 409 on a retry means the first try landed).
    `name` is the router's process name in the fleet, for its log; `extra`, more fields of
    the body (e.g. ``kv_events``)."""
    headers = {"Authorization": f"Bearer {fleet.token}"}
    body = {"url": url, **(extra or {})}
    for attempt in range(1, REGISTER_ATTEMPTS + 1):
        async with session.post(f"{router}/api/workers", json=body, headers=headers) as r:
            text = await r.text()
        if r.status == 201 or (r.status == 409 and attempt > 1):
            return
        if r.status < 500 or attempt == REGISTER_ATTEMPTS:
            raise RuntimeError(
                f"registering {url}: HTTP {r.status} {text[:300]}\n"
                f"{name} log:\n{fleet.log_tail(name)}"
            )
        log(f"registering {url}: HTTP {r.status}, retrying; {name} log:\n{fleet.log_tail(name)}")
        await asyncio.sleep(0.5)


async def listed_workers(session: aiohttp.ClientSession, router: str) -> list[dict[str, Any]]:
    """The router's ``GET /list_workers``: every worker it knows, with its state and loads."""
    async with session.get(f"{router}/list_workers") as resp:
        listed: list[dict[str, Any]] = orjson.loads(await resp.read())["workers"]
    return listed


async def register_workers(
    session: aiohttp.ClientSession,
    fleet: Fleet,
    router: str,
    urls: list[str],
    name: str = "router",
    extra: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Register every worker, then wait until the router lists all of them as routable.
    `extra`: more body fields by worker URL (register_worker)."""
    for url in urls:
        await register_worker(session, fleet, router, url, name, (extra or {}).get(url))

    async def all_routable() -> bool:
        workers = await listed_workers(session, router)
        return sum(1 for w in workers if w["routable"]) == len(urls)

    await wait_ready("all workers routable", all_routable, fleet, timeout=30)


async def snapshot_generation(session: aiohttp.ClientSession, router: str) -> int:
    async with session.get(f"{router}/health") as resp:
        return int(orjson.loads(await resp.read())["snapshot_generation"])


async def set_model_policy(
    session: aiohttp.ClientSession, fleet: Fleet, router: str, models: list[str], policy: str
) -> None:
    """PATCH each model's policy, then wait until the router has loaded a newer snapshot."""
    headers = {"Authorization": f"Bearer {fleet.token}"}
    before = await snapshot_generation(session, router)
    for model in models:
        url = f"{router}/api/models/{model}"
        async with session.patch(url, json={"policy": policy}, headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"PATCH {url}: HTTP {r.status} {(await r.text())[:300]}")
            await r.read()

    async def reloaded() -> bool:
        return await snapshot_generation(session, router) > before

    await wait_ready(f"{router} on policy {policy}", reloaded, fleet, timeout=30)
