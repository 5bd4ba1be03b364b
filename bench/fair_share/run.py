"""Fair share as a new user tries it (#30): two client keys of weights 3 and 1, the same
number of closed loops each, saturating one pool.

bench.governance measures fair share with the weight-1 key flooding three times harder
(48 open requests against 16) beside a critical and a sheddable key; a new user gives both
keys the same client (LOOPS open requests each), as here. The pool is governance's: 2
simulated workers with CONTROLPANEL_MAX_INFLIGHT_PER_WORKER=4 (8 slots), streamed chat of
MAX_TOKENS tokens at its TTFT and ITL (about 0.25 s a request), one router requiring keys.

* ``--agents``: each key is one coding agent naming its session the agent's own way, the
  weight-3 key Claude Code (``x-claude-code-session-id``), the weight-1 key Codex
  (``session_id``), so the fair queue's flows are (key, session) (routing.admission.fair_queue).
* ``--tree DIR``: the router runs from another checkout (e.g. the commit before a change,
  from ``git archive``), with the same flags and environment.

Reported per round and as the median of the rounds: the weight-3 key's share of the
completions (200, stream ended with [DONE]) that ended in the window, which opens WARMUP_S
after the loops start and closes when they stop sending. Target: 0.75 within ±0.07.

Run: ``.venv/bin/python -m bench.fair_share [--rounds 3] [--agents] [--tree DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.common.output import log, machine_info, write_json
from bench.common.router_api import http_ok, register_worker
from bench.common.wire import DONE
from bench.governance.run import ITL_MS, MAX_TOKENS, MODEL, PER_WORKER, TTFT_MS, WORKERS
from harness.fleet import (
    HOST,
    PYTHON,
    ROOT,
    Fleet,
    run_with_fleet,
    start_router,
    start_simulated_worker,
    wait_ready,
)
from harness.processes import free_ports
from harness.procfs import machine_ticks

LOOPS = 8  # open requests per key: together twice the pool's slots
WINDOW_S, WARMUP_S = 20.0, 4.0
KEYS = {"heavy": 3.0, "light": 1.0}
AGENT_HEADERS = {"heavy": "x-claude-code-session-id", "light": "session_id"}


async def one_request(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> tuple[float, bool]:
    """When the answer ended, and whether it was a whole 200 stream."""
    body = orjson.dumps({
        "model": MODEL, "stream": True, "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": "tell me something"}],
    })  # fmt: skip
    async with session.post(url, data=body, headers=headers) as resp:
        tail = b""
        async for chunk in resp.content.iter_any():
            tail = (tail + chunk)[-64:]
        return time.monotonic(), resp.status == 200 and tail.endswith(DONE)


async def one_round(
    session: aiohttp.ClientSession, url: str, headers: dict[str, dict[str, str]]
) -> dict[str, Any]:
    start = time.monotonic()
    until = start + WINDOW_S
    ended: dict[str, list[tuple[float, bool]]] = {key: [] for key in KEYS}

    async def lane(key: str) -> None:
        while time.monotonic() < until:
            ended[key].append(await one_request(session, url, headers[key]))

    await asyncio.gather(*(lane(key) for key in KEYS for _ in range(LOOPS)))
    counted = {
        key: sum(1 for at, ok in rows if ok and start + WARMUP_S <= at < until)
        for key, rows in ended.items()
    }
    failed = sum(1 for rows in ended.values() for _, ok in rows if not ok)
    share = counted["heavy"] / max(1, sum(counted.values()))
    return {"heavy_share": round(share, 3), "completions": counted, "failed": failed}


async def benchmark(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    router_port, *worker_ports = free_ports(1 + WORKERS)
    for i, port in enumerate(worker_ports):
        start_simulated_worker(fleet, f"sim-{i}", port, MODEL, TTFT_MS, ITL_MS)
    fleet.env.update(
        CONTROLPANEL_REQUIRE_API_KEY="1", CONTROLPANEL_MAX_INFLIGHT_PER_WORKER=str(PER_WORKER),
        CONTROLPANEL_QUEUE_TIMEOUT="60", CONTROLPANEL_QUEUE_MAX="100000",
    )  # fmt: skip
    tree = Path(args.tree).resolve() if args.tree else ROOT
    start_router(fleet, router_port, tree=tree)
    base = f"http://{HOST}:{router_port}"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=90)
    ) as session:
        health = f"{base}/health"
        await wait_ready("router", lambda: http_ok(session, health), fleet)
        for port in worker_ports:
            await register_worker(session, fleet, base, f"http://{HOST}:{port}")
        env = {**fleet.env, **fleet.tree_env("router", tree)}
        headers = {}
        for name, weight in KEYS.items():
            made = subprocess.run(
                [PYTHON, "manage.py", "create_api_key", name, "--weight", str(weight)],
                cwd=tree, env=env, capture_output=True, timeout=60, check=True,
            )  # fmt: skip
            headers[name] = {
                "Authorization": f"Bearer {made.stdout.decode().strip()}",
                "Content-Type": "application/json",
            }
            if args.agents:
                headers[name][AGENT_HEADERS[name]] = str(uuid.uuid4())

        async def routable() -> bool:
            auth = {"Authorization": headers["light"]["Authorization"]}
            async with session.get(f"{base}/v1/models", headers=auth) as resp:
                return resp.status == 200 and MODEL in (await resp.text())

        await wait_ready("keys and workers", routable, fleet)
        rounds = []
        for number in range(1, args.rounds + 1):
            ticks = machine_ticks()
            figures = await one_round(session, f"{base}/v1/chat/completions", headers)
            busy, total = (a - b for a, b in zip(machine_ticks(), ticks, strict=True))
            figures["machine_busy_pct"] = round(100 * busy / max(total, 1), 1)
            log(f"round {number}: {figures}")
            rounds.append(figures)
    median = statistics.median(r["heavy_share"] for r in rounds)
    return {
        "machine": machine_info(),
        "tree": str(tree),
        "commit": _commit(tree),
        "setup": {
            "workers": WORKERS, "per_worker_inflight": PER_WORKER, "loops_per_key": LOOPS,
            "weights": KEYS, "agents": AGENT_HEADERS if args.agents else None,
            "window_s": WINDOW_S, "warmup_s": WARMUP_S,
        },
        "median_heavy_share": median,
        "target_within_0.07_of_0.75": abs(median - 0.75) <= 0.07,
        "rounds": rounds,
    }  # fmt: skip


def _commit(tree: Path) -> str:
    found = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    )
    return found.stdout.strip() or "(not a git checkout)"


def main() -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--agents", action="store_true", help="each key one agent session")
    parser.add_argument("--tree", default="", help="run the router from this checkout")
    args = parser.parse_args()
    result = run_with_fleet(lambda fleet: benchmark(fleet, args))
    if result is None:
        sys.exit(130)
    name = "fair-share-agents" if args.agents else "fair-share"
    path = write_json(name, result)
    print(orjson.dumps({k: result[k] for k in ("median_heavy_share", "commit")}).decode())
    print(f"full result: {path}")
    return 0
