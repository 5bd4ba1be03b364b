"""Traffic governance under overload (#17): priority classes, fair share and no lost request.

Four client keys share 2 simulated workers behind one router that requires keys, with a
per-worker in-flight limit (CONTROLPANEL_MAX_INFLIGHT_PER_WORKER), so the router's
admission is the bottleneck and not the engine (each simulated engine batches far more):

* ``interactive``: `critical`, streams at a steady rate (INTERACTIVE_RPS, evenly spaced);
* ``batch-1`` and ``batch-3``: `standard`, weights 1 and 3, closed loops keeping
  BATCH1_OUTSTANDING and BATCH3_OUTSTANDING requests open (both always have queued work,
  and the weight-1 key floods three times harder);
* ``noisy``: `sheddable`, open loop at NOISY_TIMES x the pool's capacity.

Each round measures the interactive key **alone** (nothing else sends) and then under
**overload** (all four at once; the first WARMUP_S seconds are not counted). Targets:

* the critical key's p99 TTFT under overload <= 1.25 x its p99 alone (same round);
* fair share: of the two standard keys' requests admitted in the window, batch-3 gets
  75 % and batch-1 25 %, each within 5 points;
* nothing lost: every answer is a 200 whose stream ends with ``[DONE]``, or a 429 with
  Retry-After; anything else (a 5xx, a cut stream, a timeout) counts as lost.

TTFT is the time to the first chunk with content. Admitted requests of a standard key are
those whose answer started (200) in the window, which ends when the loops stop sending (the
queue's drain after that is one key's alone). The report gives the median of the rounds
and every round's figures, the machine and its other load.

With ``--routers N`` the router is ``manage.py serve --routers N`` (N processes on the one
port, the kernel spreading connections over them) on a fresh PostgreSQL database and a Redis
db of its own: the in-flight limits are leased through Redis (routing.admission.leases) and each
process
queues fairly among what it holds, so this measures fair share across router processes.

With ``--pinned`` two replicas (uvicorn each, its own port) share the database and Redis,
and the keys are pinned: interactive and batch-1 to the first, batch-3 and noisy to the
second (as a client-side pool or a sticky load balancer would), so fair share between the
two standard keys can only come from how the leases split the limit between the routers.

Run: ``.venv/bin/python -m bench.governance [--rounds 3] [--routers 2 | --pinned]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import astuple, dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.common.output import log, machine_info, percentile, write_json
from bench.common.router_api import http_ok, register_worker
from bench.common.wire import CONTENT_RE, DONE
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
    PYTHON,
    ROOT,
    Fleet,
    run_async,
    run_with_fleet,
    start_router,
    start_simulated_worker,
    wait_ready,
)
from harness.processes import free_ports
from harness.procfs import machine_ticks

MODEL = "gov-model"
WORKERS = 2
PER_WORKER = 4  # in-flight slots per worker: 8 in all
TTFT_MS, ITL_MS, MAX_TOKENS = 50, 10, 20  # about 0.25 s a request
CAPACITY_RPS = WORKERS * PER_WORKER / ((TTFT_MS + ITL_MS * MAX_TOKENS) / 1000)
INTERACTIVE_RPS = 4.0
BATCH1_OUTSTANDING, BATCH3_OUTSTANDING = 48, 16
NOISY_TIMES = 5
ALONE_S, OVERLOAD_S, WARMUP_S = 15.0, 20.0, 4.0
# With --pinned: these keys go to the second replica only, the others to the first, so each
# standard key's share can only come from how the routers split the limit between them.
PINNED_TO_B = ("batch-3", "noisy")
KEYS = {  # name: (priority, weight)
    "interactive": ("critical", 1.0),
    "batch-1": ("standard", 1.0),
    "batch-3": ("standard", 3.0),
    "noisy": ("sheddable", 1.0),
}


@dataclass
class Outcome:
    started: float
    status: int = 0
    ttft: float | None = None
    complete: bool = False
    retry_after: bool = False
    error: str = ""


@dataclass
class Tally:
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)

    def add(self, key: str, outcome: Outcome) -> None:
        self.outcomes.setdefault(key, []).append(outcome)


async def one_request(session: aiohttp.ClientSession, url: str, secret: str) -> Outcome:
    body = orjson.dumps({
        "model": MODEL, "stream": True, "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": "tell me something"}],
    })  # fmt: skip
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    outcome = Outcome(time.monotonic())
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            outcome.status = resp.status
            outcome.retry_after = bool(resp.headers.get("Retry-After"))
            tail = b""
            async for chunk in resp.content.iter_any():
                if outcome.ttft is None and resp.status == 200 and CONTENT_RE.search(chunk):
                    outcome.ttft = time.monotonic() - outcome.started
                tail = (tail + chunk)[-64:]
            outcome.complete = tail.endswith(DONE)
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome.error = type(exc).__name__
    return outcome


async def steady(
    session: Any, url: str, secret: str, rps: float, until: float, out: list[Any]
) -> None:
    """Open loop: one request every 1/rps seconds, whatever the answers do."""
    tasks: list[asyncio.Task[Outcome]] = []
    next_at = time.monotonic()
    while next_at < until:
        tasks.append(asyncio.create_task(one_request(session, url, secret)))
        next_at += 1.0 / rps
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    out.extend(await asyncio.gather(*tasks))


async def closed_loop(
    session: Any, url: str, secret: str, n: int, until: float, out: list[Any]
) -> None:
    async def lane() -> None:
        while time.monotonic() < until:
            out.append(await one_request(session, url, secret))

    await asyncio.gather(*(lane() for _ in range(n)))


async def phase(
    session: aiohttp.ClientSession, urls: dict[str, str], secrets: dict[str, str],
    seconds: float, everyone: bool,
) -> dict[str, list[Outcome]]:  # fmt: skip
    """The interactive key from this process; with `everyone`, the other three from a
    process of their own (`--background`), so the interactive key's TTFT is not measured
    through an event loop that also runs hundreds of other requests a second."""
    until = time.monotonic() + seconds
    got: dict[str, list[Outcome]] = {name: [] for name in KEYS}
    others = None
    if everyone:
        others = await asyncio.create_subprocess_exec(
            PYTHON, "-m", "bench.governance", "--background", orjson.dumps(urls).decode(),
            orjson.dumps(secrets).decode(), str(until),
            stdout=asyncio.subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
    url = urls["interactive"]
    await steady(session, url, secrets["interactive"], INTERACTIVE_RPS, until, got["interactive"])
    if others is not None:
        out, _ = await others.communicate()
        if others.returncode != 0:
            raise RuntimeError(f"the background load failed ({others.returncode})")
        for key, rows in orjson.loads(out).items():
            got[key] = [Outcome(*row) for row in rows]
    return got


async def background(urls: dict[str, str], secrets: dict[str, str], until: float) -> None:
    """The batch and noisy keys until `until` (CLOCK_MONOTONIC, which every process shares);
    their outcomes go to stdout as JSON."""
    got: dict[str, list[Outcome]] = {name: [] for name in ("batch-1", "batch-3", "noisy")}
    s, g = secrets, got
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=90)
    ) as session:
        await asyncio.gather(
            closed_loop(
                session, urls["batch-1"], s["batch-1"], BATCH1_OUTSTANDING, until, g["batch-1"]
            ),
            closed_loop(
                session, urls["batch-3"], s["batch-3"], BATCH3_OUTSTANDING, until, g["batch-3"]
            ),
            steady(
                session, urls["noisy"], s["noisy"], NOISY_TIMES * CAPACITY_RPS, until, g["noisy"]
            ),
        )
    rows = {k: [astuple(o) for o in v] for k, v in got.items()}
    sys.stdout.write(orjson.dumps(rows).decode())


def lost(outcomes: list[Outcome]) -> int:
    """Neither a whole 200 stream nor a 429 with Retry-After."""
    return sum(
        1 for o in outcomes
        if not ((o.status == 200 and o.complete) or (o.status == 429 and o.retry_after))
    )  # fmt: skip


def p99_ttft(outcomes: list[Outcome], since: float) -> float:
    ttfts = [o.ttft for o in outcomes if o.ttft is not None and o.started >= since]
    return percentile(ttfts, 99) * 1000


def round_figures(
    alone: dict[str, list[Outcome]], over: dict[str, list[Outcome]], t0: float
) -> dict[str, Any]:
    window, end = t0 + WARMUP_S, t0 + OVERLOAD_S
    # Admitted while both keys still sent: once the loops stop, the queue drains, and the
    # key with more requests left queued takes every slot (that says nothing about sharing).
    admitted = {
        k: sum(1 for o in over[k] if o.status == 200 and window <= o.started + (o.ttft or 0) < end)
        for k in ("batch-1", "batch-3")
    }
    both = sum(admitted.values()) or 1
    statuses = {k: dict(Counter(o.status for o in v)) for k, v in over.items()}
    p99_alone = p99_ttft(alone["interactive"], 0)
    p99_over = p99_ttft(over["interactive"], window)
    return {
        "critical_p99_ttft_alone_ms": round(p99_alone, 1),
        "critical_p99_ttft_overload_ms": round(p99_over, 1),
        "critical_p99_ratio": round(p99_over / p99_alone, 3),
        "batch3_share_pct": round(100 * admitted["batch-3"] / both, 1),
        "batch1_share_pct": round(100 * admitted["batch-1"] / both, 1),
        "admitted_in_window": admitted,
        "lost": {
            k: lost(v) for k, v in {**over, "interactive-alone": alone["interactive"]}.items()
        },
        "statuses": statuses,
        "critical_shed": sum(1 for o in over["interactive"] if o.status == 429),
    }


def create_keys(fleet: Fleet) -> dict[str, str]:
    secrets = {}
    for name, (priority, weight) in KEYS.items():
        result = subprocess.run(
            [PYTHON, "manage.py", "create_api_key", name, "--priority", priority,
             "--weight", str(weight)],
            cwd=ROOT, env=fleet.env, capture_output=True, timeout=60, check=True,
        )  # fmt: skip
        secrets[name] = result.stdout.decode().strip()
    return secrets


async def benchmark(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    router_port, *worker_ports = free_ports(1 + WORKERS)
    for i, port in enumerate(worker_ports):
        start_simulated_worker(fleet, f"sim-{i}", port, MODEL, TTFT_MS, ITL_MS)
    fleet.env.update(
        CONTROLPANEL_REQUIRE_API_KEY="1", CONTROLPANEL_MAX_INFLIGHT_PER_WORKER=str(PER_WORKER),
        CONTROLPANEL_QUEUE_TIMEOUT="60", CONTROLPANEL_QUEUE_MAX="100000",
    )  # fmt: skip
    pinned_port = 0
    if args.pinned:  # two replicas, each key sent to one of them (PINNED)
        pinned_port = free_ports(1)[0]
        start_router(fleet, router_port, name="replica-a")
        start_router(fleet, pinned_port, name="replica-b")
    elif args.routers == 1:
        start_router(fleet, router_port)
    else:  # N processes on the one port, sharing leases through Redis (serve --routers N)
        fleet.spawn("serve", [
            PYTHON, "manage.py", "serve", "--routers", str(args.routers), "--no-celery",
            "--host", HOST, "--port", str(router_port),
        ])  # fmt: skip
    base = f"http://{HOST}:{router_port}"
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=90)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await wait_ready("router", lambda: http_ok(session, f"{base}/health"), fleet)
        for port in worker_ports:
            await register_worker(session, fleet, base, f"http://{HOST}:{port}")
        secrets = create_keys(fleet)
        auth = {"Authorization": f"Bearer {secrets['noisy']}"}

        async def routable() -> bool:  # /list_workers needs a key too; /v1/models lists it
            async with session.get(f"{base}/v1/models", headers=auth) as resp:
                return resp.status == 200 and MODEL in (await resp.text())

        await wait_ready("keys and workers", routable, fleet)
        if args.reserve is not None:
            admin = {"Authorization": f"Bearer {fleet.token}"}
            body = {"priority_reserve": args.reserve}
            async with session.patch(f"{base}/api/models/{MODEL}", json=body, headers=admin) as r:
                if r.status != 200:
                    raise RuntimeError(f"setting priority_reserve: {r.status} {await r.text()}")
            await asyncio.sleep(2)  # every router process has the new snapshot
        urls = {key: f"{base}/v1/chat/completions" for key in KEYS}
        if args.pinned:
            await wait_ready(
                "replica b",
                lambda: http_ok(session, f"http://{HOST}:{pinned_port}/health"),
                fleet,
            )
            for key in PINNED_TO_B:
                urls[key] = f"http://{HOST}:{pinned_port}/v1/chat/completions"
        results = []
        for number in range(1, args.rounds + 1):
            ticks_before = machine_ticks()
            alone = await phase(session, urls, secrets, ALONE_S, everyone=False)
            t0 = time.monotonic()
            over = await phase(session, urls, secrets, OVERLOAD_S, everyone=True)
            figures = round_figures(alone, over, t0)
            busy, total = (a - b for a, b in zip(machine_ticks(), ticks_before, strict=True))
            figures["machine_busy_pct"] = round(100 * busy / max(total, 1), 1)  # all processes
            log(f"round {number}: {figures}")
            results.append(figures)
        queue_waits = await router_queue_waits(session, base, 1 if args.pinned else args.routers)
    reserve = args.reserve if args.reserve is not None else "default (0.2)"
    routers = "2 replicas, keys pinned" if args.pinned else args.routers
    return {**summary(results), "routers": routers, "priority_reserve": reserve,
            "queue_waits": queue_waits}  # fmt: skip


async def router_queue_waits(
    session: aiohttp.ClientSession, base: str, routers: int
) -> dict[str, dict[str, float]]:
    """Per class, over the whole run and every router process: requests that waited in a
    router's queue and their mean wait, from /metrics (behind one port the kernel picks the
    process, so it is asked until each has answered)."""
    seen: dict[str, dict[str, float]] = {}
    for _ in range(20 * routers):
        async with session.get(f"{base}/metrics") as resp:
            text = await resp.text()
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
        seen[values.get("process_start_time_seconds", "")] = {
            k: float(v) for k, v in values.items() if "controlpanel_router_class_wait" in k
        }
        if len(seen) == routers:
            break
    waits: dict[str, dict[str, float]] = {}
    for name in ("critical", "standard"):
        label = f'{{class="{name}",model="{MODEL}"}}'
        count = sum(
            m.get(f"controlpanel_router_class_waited_total{label}", 0) for m in seen.values()
        )
        total = sum(
            m.get(f"controlpanel_router_class_wait_seconds_total{label}", 0) for m in seen.values()
        )
        waits[name] = {
            "waited": count,
            "mean_wait_ms": round(1000 * total / count, 1) if count else 0,
        }
    return waits


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float:
        return float(statistics.median(r[key] for r in results))

    ratio, share3 = median("critical_p99_ratio"), median("batch3_share_pct")
    lost_total = sum(sum(r["lost"].values()) for r in results)
    return {
        "machine": machine_info(),
        "setup": {
            "workers": WORKERS, "per_worker_inflight": PER_WORKER, "capacity_rps": CAPACITY_RPS,
            "interactive_rps": INTERACTIVE_RPS, "noisy_rps": NOISY_TIMES * CAPACITY_RPS,
            "batch_outstanding": [BATCH1_OUTSTANDING, BATCH3_OUTSTANDING],
            "alone_s": ALONE_S, "overload_s": OVERLOAD_S, "warmup_s": WARMUP_S,
        },
        "median": {
            "critical_p99_ttft_alone_ms": median("critical_p99_ttft_alone_ms"),
            "critical_p99_ttft_overload_ms": median("critical_p99_ttft_overload_ms"),
            "critical_p99_ratio": ratio,
            "batch3_share_pct": share3,
            "batch1_share_pct": median("batch1_share_pct"),
        },
        "targets": {
            "critical_p99_ratio_le_1.25": ratio <= 1.25,
            "fair_share_within_5_points": abs(share3 - 75) <= 5,
            "nothing_lost": lost_total == 0,
        },
        "rounds": results,
    }  # fmt: skip


def main() -> int:
    if sys.argv[1:2] == ["--background"]:  # phase()'s other process
        urls, secrets, until = sys.argv[2:5]
        run_async(background(orjson.loads(urls), orjson.loads(secrets), float(until)))  # type: ignore[arg-type]
        return 0
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--routers", type=int, default=1,
        help="router processes on the one port (serve --routers N), on PostgreSQL and Redis",
    )  # fmt: skip
    parser.add_argument(
        "--pinned", action="store_true",
        help="two replicas on PostgreSQL and Redis, batch-3 and noisy sent to the second only",
    )  # fmt: skip
    parser.add_argument(
        "--reserve", type=float, default=None,
        help="the model's priority_reserve (default: the model's default, 0.2)",
    )  # fmt: skip
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL, help="for --routers above 1")
    parser.add_argument("--redis", default=DEFAULT_REDIS, help="for --routers above 1")
    parser.add_argument("--redis-db", type=int, default=DEFAULT_REDIS_DB)
    args = parser.parse_args()
    db = PostgresDatabase(args.pg_url, name=f"bench_governance_{os.getpid()}")
    redis = redis_url(args.redis, args.redis_db)

    def with_shared_state(fleet: Fleet) -> Any:
        if args.routers > 1 or args.pinned:
            db.create()
            flush_redis(redis)
            fleet.env.update(DATABASE_URL=db.url, REDIS_URL=redis)
        return benchmark(fleet, args)

    try:
        result = run_with_fleet(with_shared_state)
    finally:
        if args.routers > 1 or args.pinned:
            flush_redis(redis)
            db.drop()
    if result is None:
        sys.exit(130)
    name = "pinned" if args.pinned else f"routers{args.routers}"
    path = write_json(f"governance-{name}", result)
    print(
        orjson.dumps(
            {k: result[k] for k in ("median", "targets")}, option=orjson.OPT_INDENT_2
        ).decode()
    )
    print(f"full result: {path}")
    return 0
