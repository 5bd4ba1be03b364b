"""How soon does a key's budget change hold in every router (#17: "within 1 s")?

One simulated worker; a key whose daily budget is used up after one chat. Each sample
changes the budget through the admin API (``PATCH /api/keys/{id}``) and then probes every
router with a chat every PROBE_MS until it applies the change:

* ``raise``: the budget is raised far above what is used; applied when a chat answers 200
  (the probes before it are 429s, which cost nothing);
* ``lower``: the budget is lowered to 1 token; applied when a chat answers 429 (the probes
  before it are answered and charged, which is what a late change costs).

The time to apply is from the PATCH's answer to the first probe that shows the change
(resolution: PROBE_MS plus one chat, a few ms). Set-ups:

* default: one router, the embedded defaults (SQLite, no Redis), as ``make run``;
* ``--shared``: two replicas (uvicorn each) on a fresh PostgreSQL database and a Redis db of
  their own; the change is made through the first and timed on both.

Run: ``.venv/bin/python -m bench.budget_change [--samples 20] [--shared]``. Prints the
median, p95 and max per router and direction, and writes ``bench/out/budget-change-*.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from functools import partial
from typing import Any

import aiohttp
import orjson

from bench.common.output import machine_info, percentile, write_json
from bench.common.router_api import http_ok, register_worker
from harness.databases import (
    DEFAULT_PG_URL,
    DEFAULT_REDIS,
    DEFAULT_REDIS_DB,
    PostgresDatabase,
    flush_redis,
    redis_url,
)
from harness.fleet import (
    HOST,
    Fleet,
    run_with_fleet,
    start_router,
    start_simulated_worker,
    wait_ready,
)
from harness.processes import free_ports

MODEL = "budget-model"
PROBE_MS = 10
GIVE_UP_S = 10.0
CHAT = orjson.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "one two"}], "max_tokens": 1}
)


async def time_to_apply(
    session: aiohttp.ClientSession, url: str, secret: str, wanted: int,
    meanwhile: tuple[int, ...] = (200, 429),
) -> float:  # fmt: skip
    """Seconds until a chat through `url` answers `wanted` (any status not in `meanwhile`
    before it is an error)."""
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    started = time.monotonic()
    while time.monotonic() - started < GIVE_UP_S:
        async with session.post(url, data=CHAT, headers=headers) as resp:
            await resp.read()
            if resp.status == wanted:
                return time.monotonic() - started
            if resp.status not in meanwhile:
                raise RuntimeError(f"probe answered {resp.status}")
        await asyncio.sleep(PROBE_MS / 1000)
    raise RuntimeError(f"no {wanted} within {GIVE_UP_S} s")


async def patch_budget(
    session: aiohttp.ClientSession, fleet: Fleet, base: str, key_id: int, tokens: int
) -> None:
    admin = {"Authorization": f"Bearer {fleet.token}"}
    body = {"daily_tokens": tokens}
    async with session.patch(f"{base}/api/keys/{key_id}", json=body, headers=admin) as resp:
        if resp.status != 200:
            raise RuntimeError(f"PATCH budget: {resp.status} {await resp.text()}")


async def one_sample(
    session: aiohttp.ClientSession, fleet: Fleet, bases: list[str], key: dict[str, Any],
    tokens: int, wanted: int,
) -> list[float]:  # fmt: skip
    await patch_budget(session, fleet, bases[0], key["id"], tokens)
    return list(
        await asyncio.gather(
            *(time_to_apply(session, f"{b}/v1/chat/completions", key["key"], wanted) for b in bases)
        )
    )


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "median_ms": round(statistics.median(ms), 1),
        "p95_ms": round(percentile(ms, 95), 1),
        "max_ms": round(max(ms), 1),
    }


async def benchmark(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    ports = free_ports(3)
    start_simulated_worker(fleet, "sim-0", ports[0], MODEL, 1, 1)
    fleet.env.update(CONTROLPANEL_REQUIRE_API_KEY="1")
    routers = ports[1:] if args.shared else ports[1:2]
    for i, port in enumerate(routers):
        start_router(fleet, port, name=f"router-{i}")
    bases = [f"http://{HOST}:{port}" for port in routers]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for base in bases:
            await wait_ready("router", partial(http_ok, session, f"{base}/health"), fleet)
        await register_worker(session, fleet, bases[0], f"http://{HOST}:{ports[0]}")
        admin = {"Authorization": f"Bearer {fleet.token}"}
        body = {"name": "budgeted", "daily_tokens": 1}
        async with session.post(f"{bases[0]}/api/keys", json=body, headers=admin) as resp:
            key = await resp.json()
        await patch_budget(session, fleet, bases[0], key["id"], 10**9)
        for base in bases:  # every router knows the key and routes the model
            url = f"{base}/v1/chat/completions"  # until then: 401, 404 or 503
            await time_to_apply(session, url, key["key"], 200, (401, 404, 429, 503))
        raised: list[list[float]] = []
        lowered: list[list[float]] = []
        for _ in range(args.samples):
            lowered.append(await one_sample(session, fleet, bases, key, 1, 429))
            raised.append(await one_sample(session, fleet, bases, key, 10**9, 200))
    per_router = {
        f"router-{i}": {
            "raise": summary([s[i] for s in raised]),
            "lower": summary([s[i] for s in lowered]),
        }
        for i in range(len(bases))
    }
    every = [v for s in raised + lowered for v in s]
    return {
        "setup": "2 replicas, PostgreSQL + Redis" if args.shared else "1 router, embedded",
        "samples": args.samples,
        "probe_ms": PROBE_MS,
        "per_router": per_router,
        "all": summary(every),
        "target_within_1s": max(every) <= 1.0,
        "machine": machine_info(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--samples", type=int, default=20, help="changes of each direction")
    parser.add_argument("--shared", action="store_true", help="two replicas, PostgreSQL + Redis")
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL)
    parser.add_argument("--redis", default=DEFAULT_REDIS)
    parser.add_argument("--redis-db", type=int, default=DEFAULT_REDIS_DB)
    args = parser.parse_args()
    db = PostgresDatabase(args.pg_url, name=f"bench_budget_{os.getpid()}")
    redis = redis_url(args.redis, args.redis_db)

    def run(fleet: Fleet) -> Any:
        if args.shared:
            db.create()
            flush_redis(redis)
            fleet.env.update(DATABASE_URL=db.url, REDIS_URL=redis)
        return benchmark(fleet, args)

    try:
        result = run_with_fleet(run)
    finally:
        if args.shared:
            flush_redis(redis)
            db.drop()
    if result is None:
        sys.exit(130)
    path = write_json("budget-change-" + ("shared" if args.shared else "embedded"), result)
    shown = {k: v for k, v in result.items() if k != "machine"}
    print(orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode())
    print(f"full result: {path}")
    return 0
