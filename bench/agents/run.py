"""Coding agents through the router (issue 30, item 5): long Claude Code sessions of agents
with different weights, saturating a pool, through one router and through two replicas.

Set-up: the routing benchmark's four simulated vLLM workers (``bench/routing/fleet.py``'s
calibrated timing: ``--ttft-ms 5 --prefill-ms-per-block 6 --itl-ms 2 --max-batch 8
--block-size 16``), publishing KV events, each with a cache of 40 % of the agents' working set
(``bench/agents/workload.py``); Celery with beat; a fresh PostgreSQL database and the run's own
Redis db, as ``bench.replicas`` has them, and its set-ups (``bench/replicas/setups.py``):
``one`` router, ``replicas2`` (two behind haproxy, round robin per request) and the client
``oracle``. The routers require client keys (CONTROLPANEL_REQUIRE_API_KEY): one key per agent,
made with ``manage.py create_api_key --weight``.

Workload (seeded, the same for every mode): four agents of weights 3, 2, 1 and 1, each running
four Claude Code sessions at once (two with ``--quick``); a session is 20-50 turns, each
re-sending the whole history plus the turn's tool results, so its prompt grows to several
thousand tokens; it names itself in ``x-claude-code-session-id`` and its agent's key is its
``Authorization``. Every session sends its next turn as soon as it has read the answer.

Saturation: the model's ``max_inflight`` (``--slots``, 6 by default: 16 sessions sending) is
set through the admin API, so the routers hold what does not fit in their fair queue (with two
replicas each admits against its Redis lease of the limit); ``--per-worker N`` uses
CONTROLPANEL_MAX_INFLIGHT_PER_WORKER=N instead, which also moves a session off its worker
while that worker is full. The client oracle sends every turn to the worker of its session's
first turn (session i to worker i mod 4: perfect stickiness) with at most as many requests in
flight as the pool has slots (a client-side semaphore, first come first served: no weights).

Modes: every policy of ``--policies`` (``kv_aware``, ``prefix_aware`` with
``bench/routing/modes.py``'s configs, ``session_affinity``) on every router set-up, and the
oracle once per round; the set-up order rotates from round to round and every run starts from
cold caches. Figures per run: the fleet's prefix-cache hit rate (the workers' counters), TTFT
p50 / p99 overall and per session, each agent's and each session's share of the completions
in the saturated window (``bench/agents/workload.py``), requests per worker, errors.
Report (``bench/agents/report.py``): medians over rounds, targets on the median of same-round
ratios.

Usage: ``.venv/bin/python -m bench.agents [--quick] [--rounds N] [--only SETUP]
[--policies a,b] [--slots N | --per-worker N]``. Prints markdown on stdout (progress on
stderr), writes ``bench/out/agents-<timestamp>.json``; exit 1 if any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from functools import partial
from typing import Any

import aiohttp
import orjson

from bench.agents.report import report
from bench.agents.workload import (
    AGENTS,
    FULL,
    QUICK,
    SEED,
    Agents,
    Record,
    agent_headers,
    build_agents,
    session_figures,
    shares,
    sizing_line,
    working_set,
)
from bench.common.output import log, machine_info, percentile, write_json
from bench.common.wire import JSON_HEADERS
from bench.replicas.setups import (
    ONE,
    ORACLE,
    REPLICAS2,
    Setup,
    ensure_haproxy,
    set_policy,
    start_setup,
    start_workers,
    stop_setup,
)
from bench.routing import fleet as rf
from bench.routing import readings as rd
from bench.routing.load import Outcome, pickers, run_sessions
from bench.routing.modes import POLICY_CONFIGS, add_config_arguments
from bench.routing.workloads import Session
from harness.databases import (
    DEFAULT_PG_URL,
    DEFAULT_REDIS,
    DEFAULT_REDIS_DB,
    PostgresDatabase,
    flush_redis,
    redis_url,
)
from harness.fleet import PYTHON, ROOT, Fleet, run_with_fleet

DEFAULT_ROUNDS = 3
SETUPS = (ONE, REPLICAS2, ORACLE)
POLICIES = ("kv_aware", "prefix_aware", "session_affinity")


# --------------------------------------------------------------------------- keys and pool


PROBE_KEY = "bench-probe"  # the benchmark's own: /list_workers and warm-ups need a key too


def create_keys(proc: Fleet) -> dict[str, str]:
    """One client key per agent, with its weight, and PROBE_KEY; name -> secret."""
    secrets = {}
    for name, weight in {**AGENTS, PROBE_KEY: 1.0}.items():
        made = subprocess.run(
            [PYTHON, "manage.py", "create_api_key", name, "--weight", str(weight)],
            cwd=ROOT, env=proc.env, capture_output=True, timeout=120, check=True,
        )  # fmt: skip
        secrets[name] = made.stdout.decode().strip()
    return secrets


async def set_max_inflight(
    http: aiohttp.ClientSession, proc: Fleet, setup: Setup, slots: int
) -> None:
    headers = {"Authorization": f"Bearer {proc.token}"}
    url = f"{setup.admin}/api/models/{rf.MODEL}"
    async with http.patch(url, json={"max_inflight": slots}, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"PATCH {url} max_inflight: HTTP {resp.status} {await resp.text()}")


async def warm_up(http: aiohttp.ClientSession, setup: Setup, secret: str) -> None:
    """Until a keyed request answers 200 through the front a few times in a row (every
    replica has loaded the keys), so no measured run pays for connection set-up either."""
    body = orjson.dumps(
        {"model": rf.MODEL, "messages": [{"role": "user", "content": "warm up"}],
         "max_tokens": 1}
    )  # fmt: skip
    headers = {**JSON_HEADERS, "Authorization": f"Bearer {secret}"}
    streak, deadline = 0, time.monotonic() + 60
    while streak < 2 * len(setup.routers) + 2:
        async with http.post(setup.front + "/v1/chat/completions", data=body, headers=headers) as r:
            await r.read()
            streak = streak + 1 if r.status == 200 else 0
        if time.monotonic() > deadline:
            raise RuntimeError(f"keyed requests through {setup.front} still fail: HTTP {r.status}")
        if not streak:
            await asyncio.sleep(0.25)


# --------------------------------------------------------------------------- one run


async def run_one(ctx: dict[str, Any], setup: Setup, policy: str, rnd: int) -> dict[str, Any]:
    """One run of the agents from cold caches: counters, the sessions, counters again."""
    http, workers, agents = ctx["http"], ctx["workers"], ctx["agents"]
    await rd.reset_workers(http, workers)
    ctx["proc"].check_alive()
    rf.revive_celery(workers)
    before = await rd.read_fleet(http, workers)
    records: dict[str, Record] = {}
    headers = ctx["headers"]

    def on_request(rid: str, s: Session, turn: int, at: float) -> None:
        records[rid] = Record(s.key, turn, at)

    def on_done(rid: str, outcome: Outcome) -> None:
        r = records[rid]
        r.ended, r.ok, r.ttft_ms = time.monotonic(), outcome.ok, 1000 * outcome.ttft

    oracle = setup.name == ORACLE
    pick = pickers(workers)["client_oracle"] if oracle else (lambda s: setup.front)
    n = len(agents.workload.sessions)
    samples, wall = await run_sessions(
        agents.workload, pick, ctx["slots"] if oracle else n, f"{setup.name}-{policy}-{rnd}",
        on_request, on_done, include_usage=True, session_headers=lambda s: headers[s.key],
    )  # fmt: skip
    after = await rd.read_fleet(http, workers)
    pairs = list(zip(after, before, strict=True))
    queries = sum(a.queries - b.queries for a, b in pairs)
    done = list(records.values())
    ttfts = [r.ttft_ms for r in done if r.ok]
    run = {
        "setup": setup.name,
        "policy": policy,
        "round": rnd,
        "requests": samples.sent,
        "errors": samples.errors,
        "error_kinds": dict(samples.error_kinds),
        "wall_s": wall,
        "hit_rate": sum(a.hits - b.hits for a, b in pairs) / queries if queries else None,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "per_worker": [a.received - b.received for a, b in pairs],
        "sessions": session_figures(done, agents),
        **shares(done, agents),
    }
    agent_shares = " ".join(f"{a[-1]} {run['share'].get(a, 0):.3f}" for a in AGENTS)
    log(
        f"  r{rnd + 1} {setup.name:<9} {policy:<16} hit {run['hit_rate'] or 0:5.3f} TTFT p50 "
        f"{run['ttft_p50_ms']:6.1f} p99 {run['ttft_p99_ms']:7.1f} ms | shares {agent_shares} "
        f"({run['completions']} in {run['window_s']:.1f} s) | workers {run['per_worker']} "
        f"| errors {run['errors']} | {wall:.1f} s"
    )
    return run


async def run_setup(ctx: dict[str, Any], name: str, rnd: int) -> list[dict[str, Any]]:
    """Start one set-up, run every policy on it (the oracle: once), stop it."""
    http, proc = ctx["http"], ctx["proc"]
    setup = await start_setup(proc, http, name, ctx["workers"].workers)
    out = []
    try:
        if name == ORACLE:
            return [await run_one(ctx, setup, ORACLE, rnd)]
        if not ctx["pool_set"]:
            if not ctx["per_worker"]:
                await set_max_inflight(http, proc, setup, ctx["slots"])
            ctx["pool_set"] = True
        await warm_up(http, setup, ctx["secrets"][PROBE_KEY])
        for policy in ctx["policies"]:
            if policy != ctx["policy_in_db"]:  # new processes: a fresh instance either way
                why = await set_policy(http, proc, setup, policy, POLICY_CONFIGS.get(policy, {}))
                if why is not None:
                    raise RuntimeError(why)
                ctx["policy_in_db"] = policy
            out.append(await run_one(ctx, setup, policy, rnd))
    finally:
        stop_setup(proc, setup)
    return out


async def benchmark(
    args: argparse.Namespace, db: PostgresDatabase, redis: str, proc: Fleet
) -> dict[str, Any]:
    proc.env.update(
        DATABASE_URL=db.url,
        REDIS_URL=redis,
        CONTROLPANEL_PROBE_INTERVAL=str(rf.PROBE_INTERVAL_S),
        CONTROLPANEL_HOUSEKEEPING_SECONDS=str(rf.PROBE_INTERVAL_S),
        CONTROLPANEL_SHUTDOWN_GRACE="5",
        CONTROLPANEL_REQUIRE_API_KEY="1",
        CONTROLPANEL_QUEUE_TIMEOUT="120",  # a saturated pool's queue, not a refusal
        CONTROLPANEL_QUEUE_MAX="100000",
    )
    if args.per_worker:
        proc.env["CONTROLPANEL_MAX_INFLIGHT_PER_WORKER"] = str(args.per_worker)
    log(f"migrating {db.name} ...")
    proc.run([PYTHON, "manage.py", "migrate", "--noinput"])
    scale = QUICK if args.quick else FULL
    agents: Agents = build_agents(scale, SEED)
    ws = working_set(agents)
    log(f"workload: {agents.workload.description}")
    log(sizing_line(ws))
    log(f"starting {rf.N_WORKERS} simulated workers publishing KV events, and Celery ...")
    workers = await start_workers(proc, ws["cache_blocks_per_worker"], kv=True)
    secrets = create_keys(proc)
    slots = args.per_worker * rf.N_WORKERS if args.per_worker else args.slots or scale.slots
    setups = [s for s in SETUPS if not args.only or s in args.only]
    runs: list[dict[str, Any]] = []
    # The probe key by default: the routers answer /list_workers only with a key (admin calls
    # name the admin token themselves).
    probe = {"Authorization": f"Bearer {secrets[PROBE_KEY]}"}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, headers=probe) as http:
        ctx: dict[str, Any] = {
            "http": http, "proc": proc, "workers": workers, "agents": agents,
            "secrets": secrets, "headers": agent_headers(secrets, agents), "slots": slots,
            "per_worker": args.per_worker, "policies": args.policies, "pool_set": False,
            "policy_in_db": "",
        }  # fmt: skip
        for rnd in range(args.rounds):
            k = rnd % len(setups)
            order = setups[k:] + setups[:k]
            log(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}")
            for name in order:
                runs += await run_setup(ctx, name, rnd)
    return {
        "runs": runs,
        "working_set": ws,
        "workload": agents.workload.description,
        "sessions": {
            s.key: {"agent": agents.agent_of[s.key], "turns": len(s.turns), "index": s.group}
            for s in agents.workload.sessions
        },
        "due": agents.due(),
        "slots": slots,
    }


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument("--quick", action="store_true", help="2 sessions per agent, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help=f"default {DEFAULT_ROUNDS}")
    parser.add_argument(
        "--only", action="append", choices=SETUPS, help="run only this set-up (repeatable)"
    )
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help=f"default {','.join(POLICIES)}"
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=0,
        help=f"the model's max_inflight: the pool the sessions saturate (default "
        f"{FULL.slots}, {QUICK.slots} with --quick); the oracle's client-side limit",
    )
    parser.add_argument(
        "--per-worker",
        type=int,
        default=0,
        metavar="N",
        help="saturate with CONTROLPANEL_MAX_INFLIGHT_PER_WORKER=N instead (4N slots; a full "
        "worker's sessions move), not the model's max_inflight",
    )
    add_config_arguments(parser)
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL, help="PostgreSQL server to use")
    parser.add_argument("--redis", default=DEFAULT_REDIS, help="Redis server (no db number)")
    parser.add_argument("--redis-db", type=int, default=DEFAULT_REDIS_DB, help="flushed, owned")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else DEFAULT_ROUNDS)
    if not 1 <= args.rounds <= 20:
        parser.error("--rounds must be between 1 and 20")
    if args.slots and args.per_worker:
        parser.error("--slots and --per-worker are two ways to size the pool: give one")
    if not 0 <= args.slots <= 1000 or not 0 <= args.per_worker <= 100:
        parser.error("--slots must be 0-1000 and --per-worker 0-100")
    if not 1 <= args.redis_db <= 15:
        parser.error("--redis-db must be between 1 and 15 (db 0 is everyone's default)")
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    POLICY_CONFIGS["prefix_aware"] = args.prefix_config
    POLICY_CONFIGS["kv_aware"] = args.kv_config
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the database is dropped too
    haproxy = ensure_haproxy()
    db = PostgresDatabase(args.pg_url, name=f"bench_agents_{os.getpid()}")
    redis = redis_url(args.redis, args.redis_db)
    started = time.monotonic()
    try:
        flush_redis(redis)
        db.create()
        measured = run_with_fleet(partial(benchmark, args, db, redis))
    finally:
        db.drop()
        flush_redis(redis)
    if measured is None:
        return 130
    result: dict[str, Any] = {
        "machine": machine_info(),
        "haproxy": haproxy,
        "config": {
            "quick": args.quick,
            "rounds": args.rounds,
            "only": args.only,
            "policies": args.policies,
            "per_worker": args.per_worker,
            "agents": AGENTS,
            "prefix_aware_config": args.prefix_config,
            "kv_aware_config": args.kv_config,
            "seed": SEED,
            "python": PYTHON,
        },
        "duration_s": round(time.monotonic() - started, 1),
        "celery_restarts": rf.CELERY_RESTARTS,
        **measured,
    }
    text, result["targets"] = report(result)
    print(text)
    path = write_json("agents", result)
    log(f"\nwrote {path.relative_to(ROOT)} ({result['duration_s']} s)")
    errors = sum(r["errors"] for r in result["runs"])
    if errors:
        log(f"WARNING: {errors} requests failed; the figures are suspect")
    return 1 if errors else 0
