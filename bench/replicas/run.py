"""Several routers in front of the same workers: one router, ``serve --routers 2``, two and
three replicas behind haproxy, and the client oracle, in one run on PostgreSQL and Redis.

Set-up: the routing benchmark's four simulated vLLM workers (``python -m simulator``, the
timing and cache geometry of ``bench/routing/fleet.py``: ``--ttft-ms 5 --prefill-ms-per-block 6
--itl-ms 2 --max-batch 8 --block-size 16``, each worker's cache 40 % of the ``prefix``
workload's working set), one Celery worker with beat for the whole run (probes every second:
the workers' queue lengths the routers balance on), a fresh PostgreSQL database
(``bench_replicas_<pid>`` on ``--pg-url``'s server, migrated once, dropped at the end) and a
Redis db of the run's own (``--redis-db``, 9 by default, FLUSHDB at the start and the end). The
workers are registered once, through the first router started, and stay in the database for
every set-up. The set-ups (``bench/replicas/setups.py``), each started for its turn and stopped
after it, so no idle router takes CPU from another set-up's runs:

* ``one``: one router (uvicorn serving ``controlpanel.asgi``, the flags of
  ``harness/fleet.py``'s ``start_router``);
* ``routers2``: one replica started as ``manage.py serve --routers 2 --no-celery``, when this
  build's ``serve`` has ``--routers`` (else reported as not available in this build);
* ``replicas2``, ``replicas3``: two or three routers behind haproxy (Debian's package, installed
  by the benchmark when missing; round robin per request, ``option http-no-delay``, keep-alive
  on both sides, 600 s client and server timeouts);
* ``replicas2c``, only when named with ``--only``: two replicas behind haproxy in TCP mode
  (round robin per connection), so each client's keep-alive connection stays with one
  replica (how a Kubernetes Service balances: per connection, not per request); reported
  beside the stream target as another condition, never for it;
* ``floor1``, ``floor2``: the oracle's choices sent through one ``bench/common/floor_proxy.py`` (the
  least a proxy on this stack costs: uvicorn, aiohttp, one JSON parse), or through two behind
  the same haproxy; so each TTFT target can be read against what a proxy that does nothing
  but forward costs on this machine, in the same run (policy "oracle" in the report);
* ``oracle``: no router; the client picks the worker itself (the routing benchmark's oracle:
  group g to worker g mod 4; round robin for the workloads without prefixes).

Workloads (``bench/replicas/measure.py``), each set-up running them in this order so every
prefix_aware run starts with a fresh policy instance: ``prefix`` with ``prefix_aware`` and with
``session_affinity``, ``skewed`` with ``prefix_aware`` (the routing benchmark's seeded sessions
and load generator, 32 in flight), ``stream``: 64-token streams with ``shortest_queue`` (closed
loop, 32 clients), and ``tiny``: the throughput scenario, one-token non-streamed requests with
``shortest_queue`` (closed loop, 64 clients). The policy is changed with ``PATCH
/api/models/{name}`` on one router; the benchmark waits until every router it can address has a
snapshot newer than the change, plus 1 s. Before every run all workers are reset (cold caches,
zeroed counters).

Figures per run: hit rate (the workers' own prefix-cache counters), TTFT mean / p50 / p99 (send
to the first content chunk), requests per worker and their spread (busiest / mean), throughput,
CPU seconds of every process (routers one by one, haproxy, Celery, workers, this load generator,
and the PostgreSQL and Redis servers read from ``/proc``), router CPU per request, and the bytes
of shared state: Redis's used_memory and the run's db's key bytes before and after, and the
routers' published bytes when they count them (``controlpanel_router_shared_bytes_total``;
"n/a" when absent). Rounds are interleaved: the set-up order rotates from round to round, so
noise hits every set-up alike; every figure is the median over rounds and every target the
median of per-round ratios (``bench/replicas/report.py``).

Usage: ``.venv/bin/python -m bench.replicas [--quick] [--rounds N] [--only SETUP]
[--workload W] [--kv [--tokenizer]] [--policy P] [--prefix-config JSON] [--kv-config JSON]
[--inflight-limit N] [--baseline FILE]``.
Prints a markdown report on stdout (progress on stderr) and writes
``bench/out/replicas-<timestamp>.json``; ``--baseline`` compares one router's CPU per
request with an earlier run's JSON. Exit 0 when every request succeeded (targets may FAIL in
the report), 1 otherwise. Every subprocess, the temporary directory, the database and the
Redis db are cleaned up on exit, error, SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.common.output import log, machine_info, write_json
from bench.common.wire import JSON_HEADERS
from bench.replicas.measure import WORKLOADS, run_one
from bench.replicas.report import medians, report, targets
from bench.replicas.setups import (
    ALL_SETUPS,
    POLICY_SETTLE_S,
    REPLICAS2C,
    ROUTERLESS,
    ROUTERS2,
    SETUPS,
    TOKENIZER,
    Setup,
    ensure_haproxy,
    serve_has_routers,
    set_policy,
    start_setup,
    start_workers,
    stop_setup,
)
from bench.routing import fleet as rf
from bench.routing.modes import POLICY_CONFIGS, add_config_arguments
from bench.routing.workloads import (
    FULL,
    QUICK,
    SEED,
    build_workloads,
    session_words,
    working_set,
)
from harness.databases import (
    DEFAULT_PG_URL,
    DEFAULT_REDIS,
    DEFAULT_REDIS_DB,
    PostgresDatabase,
    flush_redis,
    redis_url,
)
from harness.fleet import PYTHON, ROOT, Fleet, run_with_fleet
from harness.procfs import machine_ticks
from harness.tokenizer_folder import build_word_tokenizer_folder
from simulator.tokens import output_text

DEFAULT_ROUNDS = 3
# (workload, policy) in the order every set-up runs them; prefix_aware never twice in a row.
PLAN = (
    ("prefix", "prefix_aware"),
    ("prefix", "session_affinity"),
    ("prefix", "kv_aware"),
    ("skewed", "prefix_aware"),
    ("skewed", "kv_aware"),
    ("stream", "shortest_queue"),
    ("tiny", "shortest_queue"),
)
STATEFUL = {"prefix_aware"}  # policies whose instance learns from traffic: start each run fresh
AWAY = "round_robin"  # switched to and back when a stateful policy would be reused


# --------------------------------------------------------------------------- the benchmark


async def warm_up(http: aiohttp.ClientSession, setup: Setup) -> None:
    """A few requests through the front (haproxy spreads them over every replica), so no
    measured run pays for connection set-up."""
    body = orjson.dumps(
        {"model": rf.MODEL, "messages": [{"role": "user", "content": "warm up"}],
         "max_tokens": 1}
    )  # fmt: skip
    for _ in range(2 * len(setup.routers) + 2):
        async with http.post(
            setup.front + "/v1/chat/completions", data=body, headers=JSON_HEADERS
        ) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"warm-up through {setup.front}: HTTP {resp.status}")


class Policies:
    """Which policy the database holds, and whether the running routers' instance of it has
    served traffic (then a stateful one is switched away and back: a fresh instance)."""

    def __init__(self, configs: dict[str, dict[str, Any]]) -> None:
        self.configs = configs  # policy -> its policy_config
        self.current: tuple[str, str] | None = None  # (policy, config as JSON)
        self.used = False

    async def use(
        self, http: aiohttp.ClientSession, proc: Fleet, setup: Setup, policy: str
    ) -> None:
        config = self.configs.get(policy, {})
        want = (policy, json.dumps(config, sort_keys=True))
        if want == self.current and self.used and policy in STATEFUL:
            await self._set(http, proc, setup, AWAY, {})
        if want != self.current:
            await self._set(http, proc, setup, policy, config)
        self.used = True

    async def _set(
        self,
        http: aiohttp.ClientSession,
        proc: Fleet,
        setup: Setup,
        policy: str,
        config: dict[str, Any],
    ) -> None:
        why = await set_policy(http, proc, setup, policy, config)
        if why is not None:
            raise RuntimeError(why)
        self.current = (policy, json.dumps(config, sort_keys=True))
        self.used = False


async def run_setup(
    ctx: dict[str, Any], name: str, rnd: int, plan: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    """Start one set-up, run the plan on it, stop it."""
    http, proc, workers, policies = ctx["http"], ctx["proc"], ctx["workers"], ctx["policies"]
    setup = await start_setup(proc, http, name, workers.workers)
    out = []
    try:
        if name not in ROUTERLESS:
            await warm_up(http, setup)
            policies.used = True  # the warm-up went through the instance in force
        oracle_done: set[str] = set()  # the oracle and the floors run each workload once
        for workload, policy in plan:
            if name in ROUTERLESS:
                if workload in oracle_done:
                    continue
                oracle_done.add(workload)
                policy = "oracle"
            else:
                await policies.use(http, proc, setup, policy)
            spec = (workload, policy, rnd, ctx["scale"])
            run = await run_one(http, proc, setup, workers, ctx["chats"], spec, ctx["redis"])
            log(
                f"  r{rnd + 1} {name:<9} {workload:<6} {policy:<16} hit {run.hit_rate:5.3f} "
                f"TTFT mean {run.ttft_mean_ms:6.1f} p99 {run.ttft_p99_ms:6.1f} ms "
                f"(engine {run.engine_ttft_ms:5.1f}, queue {run.queue_wait_ms:5.1f}) "
                f"| {run.rps:7.1f} req/s | workers {run.per_worker} | router CPU "
                f"{run.router_cpu_ms_per_req:.3f} ms/req | accuracy {run.accuracy:.3f} "
                f"({run.checked:.0f}) | decisions {run.decisions} | errors {run.errors} "
                f"| {run.wall_s:.1f} s"
            )
            out.append(asdict(run))
    finally:
        stop_setup(proc, setup)
    return out


def quiet_check(seconds: float = 2.0) -> float:
    """How busy the machine is before the benchmark starts anything, in %."""
    busy0, total0 = machine_ticks()
    time.sleep(seconds)
    busy1, total1 = machine_ticks()
    return 100 * (busy1 - busy0) / max(total1 - total0, 1)


async def benchmark(
    args: argparse.Namespace, db: PostgresDatabase, redis: str, proc: Fleet
) -> dict[str, Any]:
    proc.env.update(
        DATABASE_URL=db.url,
        REDIS_URL=redis,
        CONTROLPANEL_PROBE_INTERVAL=str(rf.PROBE_INTERVAL_S),
        CONTROLPANEL_HOUSEKEEPING_SECONDS=str(rf.PROBE_INTERVAL_S),
        CONTROLPANEL_SHUTDOWN_GRACE="5",
    )
    if args.inflight_limit:
        proc.env["CONTROLPANEL_MAX_INFLIGHT_PER_WORKER"] = str(args.inflight_limit)
    log(f"migrating {db.name} ...")
    proc.run([PYTHON, "manage.py", "migrate", "--noinput"])
    unavailable: dict[str, str] = {}
    setups = [s for s in ALL_SETUPS if s in args.only] if args.only else list(SETUPS)
    if ROUTERS2 in setups and not serve_has_routers(proc):
        unavailable[ROUTERS2] = "not available in this build (`manage.py serve` has no --routers)"
        setups.remove(ROUTERS2)
    scale = QUICK if args.quick else FULL
    chats = build_workloads(scale, SEED)
    ws = working_set(chats["prefix"])
    log(f"starting {rf.N_WORKERS} simulated workers and Celery ...")
    tokenizer = ""
    if args.tokenizer:
        words = {w for load in chats.values() for s in load.sessions for w in session_words(s)}
        vocabulary = sorted(words | set(output_text(rf.MAX_TOKENS).split()))
        tokenizer = str(build_word_tokenizer_folder(proc.tmp / "tokenizer", vocabulary))
        TOKENIZER["folder"] = tokenizer
        log(f"tokenizer folder {tokenizer}: one token per word, {len(vocabulary)} words")
    workers = await start_workers(proc, ws["cache_blocks_per_worker"], args.kv, tokenizer)
    plan = [
        (w, p)
        for w, p in PLAN
        if (not args.workload or w in args.workload)
        and (args.kv or p != "kv_aware")
        and (not args.policy or p in args.policy)
    ]
    runs: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        ctx = {
            "http": http,
            "proc": proc,
            "workers": workers,
            "policies": Policies(
                {**POLICY_CONFIGS, "prefix_aware": args.prefix_config, "kv_aware": args.kv_config}
            ),
            "chats": chats,
            "scale": "quick" if args.quick else "full",
            "redis": redis,
        }
        for rnd in range(args.rounds):
            k = rnd % len(setups)
            order = setups[k:] + setups[:k]  # rotate the order from round to round
            log(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}")
            for name in order:
                runs += await run_setup(ctx, name, rnd, plan)
    return {"runs": runs, "unavailable": unavailable, "working_set": ws}


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument("--quick", action="store_true", help="smaller workloads, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help=f"default {DEFAULT_ROUNDS}")
    parser.add_argument(
        "--only",
        action="append",
        choices=ALL_SETUPS,
        metavar="SETUP",
        help=f"run only this set-up (repeatable): {', '.join(ALL_SETUPS)} ({REPLICAS2C}: "
        "two replicas behind haproxy in TCP mode, a client connection kept on one replica; "
        "only when named)",
    )
    parser.add_argument(
        "--workload",
        action="append",
        choices=WORKLOADS,
        metavar="W",
        help=f"run only this workload (repeatable): {', '.join(WORKLOADS)} "
        "(tiny is the throughput scenario)",
    )
    parser.add_argument(
        "--kv",
        action="store_true",
        help="workers publish KV events (registered with kv_events), report cached tokens, "
        "and the plan adds kv_aware on prefix and skewed",
    )
    parser.add_argument(
        "--tokenizer",
        action="store_true",
        help="with --kv: a tokenizer folder made here on the workloads' words, loaded by the "
        "workers and named as the model's tokenizer, so kv_aware tokenizes locally "
        "(routing_policies.py --tokenizer's)",
    )
    parser.add_argument(
        "--policy",
        action="append",
        metavar="P",
        help="run only the plan's entries with this policy (repeatable)",
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--inflight-limit",
        type=int,
        default=0,
        metavar="N",
        help="CONTROLPANEL_MAX_INFLIGHT_PER_WORKER for every router (fleet-wide with Redis): "
        "set to the workers' --max-batch, routers hold a request until a slot is free instead "
        "of queueing it at a full worker; a condition of the run, default 0 (no limit)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="FILE",
        help="an earlier bench/out/replicas-*.json to compare one router's CPU/request with",
    )
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL, help="PostgreSQL server to use")
    parser.add_argument("--redis", default=DEFAULT_REDIS, help="Redis server (no db number)")
    parser.add_argument(
        "--redis-db",
        type=int,
        default=DEFAULT_REDIS_DB,
        help="the Redis db the run owns: flushed at the start and the end",
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else DEFAULT_ROUNDS
    if not 1 <= args.rounds <= 20:
        parser.error("--rounds must be between 1 and 20")
    if args.tokenizer and not args.kv:
        parser.error("--tokenizer needs --kv")
    if not 0 <= args.inflight_limit <= 10_000:
        parser.error("--inflight-limit must be between 0 and 10000")
    if not 1 <= args.redis_db <= 15:
        parser.error("--redis-db must be between 1 and 15 (db 0 is everyone's default)")
    if args.baseline is not None and not args.baseline.is_file():
        parser.error(f"--baseline {args.baseline}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the database is dropped too
    haproxy = ensure_haproxy()
    busy_before = quiet_check()
    log(f"machine busy before the run: {busy_before:.0f} % (other load)")
    db = PostgresDatabase(args.pg_url, name=f"bench_replicas_{os.getpid()}")
    redis = redis_url(args.redis, args.redis_db)
    started = time.monotonic()
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    try:
        found = flush_redis(redis)
        if found:
            log(f"Redis db {args.redis_db} held {found} keys (a previous run's?); flushed")
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
        "loadavg_before": loadavg_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "busy_before_pct": busy_before,
        "config": {
            "quick": args.quick,
            "rounds": args.rounds,
            "only": args.only,
            "workload": args.workload,
            "kv": args.kv,
            "tokenizer": args.tokenizer,
            "policy": args.policy,
            "workers": rf.N_WORKERS,
            "database": f"{db.name} on {args.pg_url.rpartition('/')[0]}",
            "redis_db": args.redis_db,
            "policy_settle_s": POLICY_SETTLE_S,
            "prefix_aware_config": args.prefix_config,
            "kv_aware_config": args.kv_config,
            "inflight_limit": args.inflight_limit,
            "seed": SEED,
            "python": PYTHON,
        },
        "duration_s": round(time.monotonic() - started, 1),
        "celery_restarts": rf.CELERY_RESTARTS,
        **measured,
    }
    result["summary"] = medians(result["runs"])
    if args.baseline is not None:
        result["baseline"] = json.loads(args.baseline.read_text())
        result["baseline_file"] = str(args.baseline)
    result["targets"] = targets(result)
    print(report(result))
    result.pop("baseline", None)
    path = write_json("replicas", result)
    log(f"\nwrote {path.relative_to(ROOT)} ({result['duration_s']} s)")
    errors = sum(r["errors"] for r in result["runs"])
    if errors:
        log(f"WARNING: {errors} requests failed; the figures are suspect")
    return 1 if errors else 0
