"""Which routing policy keeps the prefix caches warm? Every policy and two client-side
baselines on the same seeded workloads, in one run.

Set-up: four simulated vLLM workers (``python -m routing.simulator``) serving one model with a
deliberately small prefix cache (sized from the ``prefix`` workload: each worker holds about 40 %
of its working set, the fleet 160 %), and timing that makes the cache matter: ``--ttft-ms 5
--prefill-ms-per-block 6 --itl-ms 2 --max-batch 8 --block-size 16``, so an uncached
1,024-word prompt (64 blocks) costs about 390 ms of prefill and a cached turn 10-40 ms. The
prefill cost is calibrated so that the two client-side baselines land where the issue's
reference figures for this workload put them (client oracle 43 ms mean TTFT, round robin
220-240 ms): prefill on a GPU is time the GPU spends, not CPU the router's machine spends,
and it is what a cache hit saves. (Until 2026-11-30 16:40 the default was 1 ms per block:
the baselines then measured 23-25 and 65 ms, and a Python proxy hop's few milliseconds of
CPU on two shared cores weighed as much as the cache; ``--prefill-ms-per-block 1`` still
reproduces that set-up.) One router (uvicorn serving
``controlpanel.asgi``) runs on a throw-away SQLite database with the four workers added through
``POST /api/workers``, and a Celery worker with beat (health probes and metrics scrapes every
second, drain housekeeping), as ``manage.py serve`` runs it. The load generator is this
script (aiohttp, streamed chat completions, ``max_tokens`` 16, 32 requests in flight at most).

Workloads (seeded, identical for every policy and baseline):

* ``prefix``: 16 groups x 8 users x 4 turns. Each group shares a 1,024-word system prompt; each
  user adds 24-40-word turns and the assistant's streamed answer is appended to the history, so
  turn k+1 extends turn k's prompt. A user's turns are sequential; all users are live at once.
* ``uniform``: as many single-turn requests of 256-512 unrelated random words.
* ``skewed``: like ``prefix`` (same request count), but half of the users share one hot system
  prompt and the other half are spread over 15 other groups.

Modes: every selected policy through the router (switched with ``PATCH /api/models/{name}``,
with the ``policy_config`` of POLICY_CONFIGS: prefix_aware's load thresholds sized for these
workers' batch of 8; ``prefix_aware@defaults`` runs it with ``{}``; unregistered policies are
skipped with a note), plus two baselines sent straight to the workers: ``client_rr`` (request
i goes to worker i mod 4) and ``client_oracle`` (group g always goes to worker g mod 4), and
``floor_oracle``: the oracle's assignment through ``bench/floor_proxy.py``, the cheapest proxy
on the router's stack, which shows what any proxy hop costs on this machine. Targets are judged
on the median over rounds of per-round ratios. Before every run all workers get ``POST
/sim/reset`` (cold caches, zeroed counters) and the router's policy instance is a fresh one (a
policy is switched away and back if the previous run used the same one and config), so each
run starts cold.

Figures per run: TTFT (send to the first SSE chunk carrying content) mean / p50 / p99,
throughput (successful requests / wall time), the fleet-wide prefix-cache hit rate from the
workers' own counters (sum of ``vllm:prefix_cache_hits_total`` deltas / sum of
``vllm:prefix_cache_queries_total`` deltas, parsed with prometheus_client), requests per worker
(``/sim/stats`` ``received`` deltas), errors and, for router runs, the policy's own decision
counts from the router's ``/metrics``.

Session affinity phase (when ``session_affinity`` is selected and registered): sessions with
short prompts, 8 in flight; which worker served each request is learnt by polling every
worker's ``/sim/stats`` request log for the unique ``X-Request-Id`` sent with it. Halfway through,
the worker that is home to most sessions is drained (``POST /api/workers/{id}/drain``); the
check is that nothing fails, nothing reaches it once the router stops routing to it, and its
sessions settle elsewhere. It is then activated again.

Usage: ``.venv/bin/python bench/routing_policies.py [--quick] [--only-workload NAME]
[--policies a,b,...]``. Prints a markdown report on stdout (progress on stderr) and writes the
figures to ``bench/out/routing-<timestamp>.json``. All traffic stays on 127.0.0.1; every
subprocess is stopped on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import math
import os
import random
import signal
import statistics
import string
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

try:  # run as `python -m bench.routing_policies` from the repository root
    from bench import overhead as oh
except ImportError:  # run as `python bench/routing_policies.py` (bench/ is on sys.path)
    import overhead as oh  # type: ignore[no-redef]

HOST = oh.HOST
ROOT = oh.ROOT
OUT_DIR = oh.OUT_DIR
PYTHON = oh.PYTHON
log = oh.log

MODEL = "bench-routing"
N_WORKERS = 4
SEED = 20261130

# Simulator timing and cache geometry (the cache size itself is derived from the workload).
TTFT_MS = 5.0
PREFILL_MS_PER_BLOCK = 6.0  # calibrated against the reference baselines, see above
ITL_MS = 2.0
MAX_BATCH = 8
BLOCK_SIZE = 16
CACHE_SHARE = 0.40  # of the prefix workload's working set, per worker
MAX_MODEL_LEN = 8192

MAX_TOKENS = 16
CONCURRENCY = 32
SYSTEM_WORDS = 1024
USER_WORDS = (24, 40)
UNIFORM_WORDS = (256, 512)
VOCAB_SIZE = 4096
REQUEST_TIMEOUT_S = 60.0
POLICY_SETTLE_S = 1.5
DEFAULT_ROUNDS = 3
PROBE_INTERVAL_S = 1.0  # health probes / metrics scrapes (Celery beat); the default is 5 s
POLICY_POLL_S = 5.0

# Affinity phase: short prompts, so polling the workers' request logs stays cheap.
AFFINITY_CONCURRENCY = 8
AFFINITY_SYSTEM_WORDS = 48
AFFINITY_USER_WORDS = (8, 16)
AFFINITY_POLL_S = 0.1
AFFINITY_THINK_S = 0.25  # pause between a session's turns, so the phase outlasts the drain
SIM_LOG_WINDOW = 50  # /sim/stats shows the last 50 logged requests per worker

# Policy configurations (policy_config), by mode. prefix_aware's load thresholds are in
# requests and scale with how many requests a worker runs at once: one batch (MAX_BATCH) of
# imbalance, not SGLang's 32, which the whole benchmark (32 in flight) can never reach. The mode
# "prefix_aware@defaults" runs it with {} too, to show what the defaults do here.
DEFAULTS_SUFFIX = "@defaults"
POLICY_CONFIGS: dict[str, dict[str, Any]] = {
    "prefix_aware": {"balance_abs_threshold": MAX_BATCH, "balance_rel_threshold": 1.5},
}
ALL_POLICIES = (
    "round_robin",
    "random",
    "shortest_queue",
    "power_of_two",
    "least_kv",
    "session_affinity",
    "prefix_aware",
    "prefix_aware@defaults",
)
BASELINES = ("client_rr", "client_oracle")
# The oracle's assignment through bench/floor_proxy.py (uvicorn + aiohttp and nothing else):
# what any proxy on this stack adds on this machine, to read the router-vs-oracle target by.
FLOOR_MODES = ("floor_oracle",)
DIRECT_MODES = (*BASELINES, *FLOOR_MODES)  # modes that do not go through the router
WORKLOADS = ("prefix", "uniform", "skewed")
DEFAULT_POLICY = "shortest_queue"

# Targets from the issue.
HIT_RATE_TARGET = 0.85
TTFT_VS_ORACLE = 1.25
SKEW_P99_VS_SQ = 1.10
UNIFORM_TOLERANCE = 0.10
STICKY_TARGET = 0.95
OTHER_LOAD_WARN_PCT = oh.OTHER_LOAD_WARN_PCT

# Reference figures from the issue: (hit rate, mean TTFT), measured by the author.
PEER_FIGURES = (
    ("client-side oracle", "0.87", "43 ms"),
    ("SGLang router, cache_aware", "0.87", "76 ms"),
    ("vllm-router, cache_aware", "0.87", "61 ms"),
    ("round robin", "0.37-0.40", "220-240 ms"),
)

JSON_HEADERS = {"Content-Type": "application/json"}
FLOOR_PIN = "/upstream/"  # bench/floor_proxy.py: /upstream/<i>/v1/... goes to upstream i


def policy_of(mode: str) -> str:
    """The policy name a router mode runs ("prefix_aware@defaults" -> "prefix_aware")."""
    return mode.removesuffix(DEFAULTS_SUFFIX)


def config_of(mode: str) -> dict[str, Any]:
    """The policy_config a router mode runs with."""
    return {} if mode.endswith(DEFAULTS_SUFFIX) else POLICY_CONFIGS.get(mode, {})


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Session:
    """One user: a session key, its group (system prompt) and its user turns, in order."""

    key: str
    group: int
    system: str | None
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    sessions: tuple[Session, ...]  # in start order

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass(frozen=True)
class Scale:
    groups: int
    users: int  # per group, for `prefix`
    turns: int
    affinity_sessions: int
    affinity_turns: int


FULL = Scale(groups=16, users=8, turns=4, affinity_sessions=32, affinity_turns=8)
QUICK = Scale(groups=8, users=4, turns=3, affinity_sessions=16, affinity_turns=6)


class Words:
    """Seeded random pseudo-words; a 16-word block never repeats by accident."""

    def __init__(self, rng: random.Random) -> None:
        letters = string.ascii_lowercase
        vocab: set[str] = set()
        while len(vocab) < VOCAB_SIZE:
            vocab.add("".join(rng.choices(letters, k=rng.randint(3, 9))))
        self.vocab = sorted(vocab)
        self.rng = rng

    def text(self, n: int) -> str:
        return " ".join(self.rng.choices(self.vocab, k=n))

    def between(self, bounds: tuple[int, int]) -> str:
        return self.text(self.rng.randint(*bounds))


def chat_sessions(
    name: str, group_of_user: list[int], n_groups: int, turns: int, seed: int
) -> tuple[Session, ...]:
    rng = random.Random(f"{seed}-{name}")
    words = Words(rng)
    systems = [words.text(SYSTEM_WORDS) for _ in range(n_groups)]
    per_group: Counter[int] = Counter()
    sessions = []
    for group in group_of_user:
        user = per_group[group]
        per_group[group] += 1
        user_turns = tuple(words.between(USER_WORDS) for _ in range(turns))
        sessions.append(Session(f"g{group:02d}-u{user:02d}", group, systems[group], user_turns))
    rng.shuffle(sessions)  # all groups are live from the start, not one group after another
    return tuple(sessions)


def build_workloads(scale: Scale, seed: int) -> dict[str, Workload]:
    g, u, t = scale.groups, scale.users, scale.turns
    prefix = Workload(
        "prefix",
        f"{g} groups x {u} users x {t} turns, {SYSTEM_WORDS}-word shared system prompt per group,"
        f" {USER_WORDS[0]}-{USER_WORDS[1]}-word user turns, answers appended to the history",
        chat_sessions("prefix", [grp for grp in range(g) for _ in range(u)], g, t, seed),
    )
    n_users = g * u
    hot = n_users // 2
    skew_groups = [0] * hot + [1 + i % (g - 1) for i in range(n_users - hot)]
    skewed = Workload(
        "skewed",
        f"{n_users} users x {t} turns: {hot} users share the hot system prompt (group 0), "
        f"{n_users - hot} are spread over {g - 1} other groups",
        chat_sessions("skewed", skew_groups, g, t, seed),
    )
    rng = random.Random(f"{seed}-uniform")
    words = Words(rng)
    n = prefix.requests
    uniform = Workload(
        "uniform",
        f"{n} single-turn requests of {UNIFORM_WORDS[0]}-{UNIFORM_WORDS[1]} unrelated random words",
        tuple(Session(f"r{i:04d}", i, None, (words.between(UNIFORM_WORDS),)) for i in range(n)),
    )
    return {"prefix": prefix, "uniform": uniform, "skewed": skewed}


def affinity_workload(scale: Scale, seed: int) -> Workload:
    rng = random.Random(f"{seed}-affinity")
    words = Words(rng)
    n_groups = 8
    systems = [words.text(AFFINITY_SYSTEM_WORDS) for _ in range(n_groups)]
    sessions = tuple(
        Session(
            f"aff-{i:02d}",
            i % n_groups,
            systems[i % n_groups],
            tuple(words.between(AFFINITY_USER_WORDS) for _ in range(scale.affinity_turns)),
        )
        for i in range(scale.affinity_sessions)
    )
    return Workload(
        "affinity",
        f"{scale.affinity_sessions} sessions x {scale.affinity_turns} turns, short prompts, "
        f"{AFFINITY_THINK_S * 1000:.0f} ms between a session's turns, at most "
        f"{AFFINITY_CONCURRENCY} in flight",
        sessions,
    )


# --------------------------------------------------------------------------- cache sizing


def chat_tokens(messages: list[dict[str, str]]) -> int:
    """The simulator's token count: each message's role, then its whitespace-separated words."""
    return sum(1 + len(m["content"].split()) for m in messages)


def working_set(workload: Workload) -> dict[str, Any]:
    """Full blocks the prefix workload touches: shared system-prompt blocks once per group,
    plus each user's private blocks (its last turn's prompt extends all the earlier ones)."""
    reply = " ".join(["w"] * MAX_TOKENS)  # the answer is always MAX_TOKENS words
    shared_blocks = (1 + SYSTEM_WORDS) // BLOCK_SIZE
    groups = sorted({s.group for s in workload.sessions})
    private = []
    for s in workload.sessions:
        assert s.system is not None
        messages = [{"role": "system", "content": s.system}]
        for turn in s.turns[:-1]:
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": s.turns[-1]})
        private.append(chat_tokens(messages) // BLOCK_SIZE - shared_blocks)
    total = len(groups) * shared_blocks + sum(private)
    per_worker = math.ceil(CACHE_SHARE * total)
    # The oracle's heaviest worker: its groups' system prompts plus their users' private blocks.
    oracle_load = [0] * N_WORKERS
    for g in groups:
        oracle_load[g % N_WORKERS] += shared_blocks
    for s, p in zip(workload.sessions, private, strict=True):
        oracle_load[s.group % N_WORKERS] += p
    return {
        "groups": len(groups),
        "users": len(workload.sessions),
        "system_tokens": 1 + SYSTEM_WORDS,
        "shared_blocks_per_group": shared_blocks,
        "shared_blocks": len(groups) * shared_blocks,
        "private_blocks": sum(private),
        "private_blocks_per_user_mean": statistics.fmean(private),
        "working_set_blocks": total,
        "cache_blocks_per_worker": per_worker,
        "fleet_cache_blocks": N_WORKERS * per_worker,
        "oracle_max_worker_blocks": max(oracle_load),
    }


def sizing_lines(ws: dict[str, Any]) -> list[str]:
    return [
        f"Cache sizing (block size {BLOCK_SIZE} tokens; a chat token is a role or a word):",
        "",
        f"* shared: {ws['groups']} system prompts x {ws['system_tokens']} tokens (role + "
        f"{SYSTEM_WORDS} words) = {ws['groups']} x {ws['shared_blocks_per_group']} full blocks "
        f"= {ws['shared_blocks']} blocks (the partial last block is not cached; it merges with "
        "the user's turn);",
        f"* private: {ws['users']} users x {ws['private_blocks_per_user_mean']:.1f} blocks on "
        f"average (their turns and answers, up to the last turn) = {ws['private_blocks']} "
        "blocks;",
        f"* working set: {ws['shared_blocks']} + {ws['private_blocks']} = "
        f"{ws['working_set_blocks']} blocks;",
        f"* per worker: {CACHE_SHARE:.0%} of it = --cache-blocks {ws['cache_blocks_per_worker']}"
        f" (less than the working set, so one worker cannot hold it); fleet: {N_WORKERS} x "
        f"{ws['cache_blocks_per_worker']} = {ws['fleet_cache_blocks']} blocks "
        f"({ws['fleet_cache_blocks'] / ws['working_set_blocks']:.0%} of the working set, so a "
        "good partition holds it all);",
        f"* the oracle's (group g -> worker g mod {N_WORKERS}) busiest worker needs "
        f"{ws['oracle_max_worker_blocks']} blocks, which fits.",
    ]


# --------------------------------------------------------------------------- fleet


@dataclass
class Fleet:
    proc: oh.Fleet
    router: str
    router_pid: int
    workers: list[str]  # base URLs, index = worker number
    worker_ids: list[int]  # router database ids, same order
    cache_blocks: int
    floor: str  # bench/floor_proxy.py, for floor_oracle
    floor_pid: int


def start_sim(fleet: oh.Fleet, name: str, port: int, cache_blocks: int) -> None:
    fleet.spawn(
        name,
        [
            PYTHON, "-m", "routing.simulator", "--host", HOST, "--port", str(port),
            "--model", MODEL, "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS),
            "--prefill-ms-per-block", str(PREFILL_MS_PER_BLOCK),
            "--max-batch", str(MAX_BATCH), "--cache-blocks", str(cache_blocks),
            "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            "--default-max-tokens", str(MAX_TOKENS),
        ],
    )  # fmt: skip


def start_celery(fleet: oh.Fleet) -> None:
    """Celery worker with beat, as `manage.py serve` runs it: the health probes that scrape
    the workers' /metrics (least_kv's input) and the housekeeping that finishes drains."""
    fleet.spawn(
        "celery",
        [
            PYTHON, "-m", "celery", "-A", "controlpanel", "worker", "--beat",
            "--pool", "threads", "--concurrency", "4", "--loglevel", "WARNING",
        ],
    )  # fmt: skip


async def start_fleet(proc: oh.Fleet, cache_blocks: int) -> Fleet:
    ports = oh.free_ports(N_WORKERS + 1)
    for i, port in enumerate(ports[1:]):
        start_sim(proc, f"worker{i}", port, cache_blocks)
    proc.env.update(
        CONTROLPANEL_PROBE_INTERVAL=str(PROBE_INTERVAL_S),
        CONTROLPANEL_HOUSEKEEPING_SECONDS=str(PROBE_INTERVAL_S),
    )
    router_pid = oh.start_router(proc, ports[0])
    start_celery(proc)
    router = f"http://{HOST}:{ports[0]}"
    workers = [f"http://{HOST}:{p}" for p in ports[1:]]
    floor_port = oh.free_ports(1)[0]
    floor_pid = oh.start_floor(proc, floor_port, {MODEL: workers})
    floor = f"http://{HOST}:{floor_port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in [*workers, router]:
            await oh.wait_until(
                f"{url}/health", partial(oh.http_ok, session, url + "/health"), proc
            )
        ping = [{"role": "user", "content": "ping"}]
        probe = orjson.dumps({"model": MODEL, "messages": ping, "max_tokens": 1})
        url = f"{floor}{FLOOR_PIN}0/v1/chat/completions"
        await oh.wait_until(f"{floor} (floor)", partial(oh.post_ok, session, url, probe), proc)
        await oh.register_workers(session, proc, router, workers)
        async with session.get(f"{router}/list_workers") as resp:
            listed = orjson.loads(await resp.read())["workers"]
    by_url = {w["url"].rstrip("/"): w["id"] for w in listed}
    ids = [by_url[u] for u in workers]
    return Fleet(proc, router, router_pid, workers, ids, cache_blocks, floor, floor_pid)


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
            total += sum(oh.cpu_times(pid))
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
        busy, total = oh.machine_ticks()
        return cls(cpu_seconds([proxy_pid]), groups, busy, total)


def cpu_figures(before: CpuMark, after: CpuMark) -> tuple[float, float, float, dict[str, float]]:
    """(router CPU seconds, machine busy %, busy % of processes not in this benchmark, CPU
    seconds by process group)."""
    ticks = max(after.total - before.total, 1)
    busy_s = (after.busy - before.busy) / oh.CLK_TCK
    groups = {k: v - before.groups.get(k, 0.0) for k, v in after.groups.items()}
    other = 100 * (busy_s - sum(groups.values())) * oh.CLK_TCK / ticks
    busy_pct = 100 * (after.busy - before.busy) / ticks
    return after.router - before.router, busy_pct, max(0.0, other), groups


# --------------------------------------------------------------------------- worker counters


def prefix_counters(text: str) -> tuple[float, float]:
    """(queries, hits) in tokens from one worker's /metrics page."""
    queries = hits = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prefix_cache_queries_total":
                queries += sample.value
            elif sample.name == "vllm:prefix_cache_hits_total":
                hits += sample.value
    return queries, hits


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


@dataclass(frozen=True)
class WorkerReading:
    queries: float
    hits: float
    received: int
    running: int
    waiting: int


async def read_worker(session: aiohttp.ClientSession, url: str) -> WorkerReading:
    async with session.get(url + "/metrics") as resp:
        queries, hits = prefix_counters(await resp.text())
    async with session.get(url + "/sim/stats") as resp:
        stats = orjson.loads(await resp.read())
    return WorkerReading(queries, hits, stats["received"], stats["running"], stats["waiting"])


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


class PolicySwitch:
    """Switches MODEL's policy through the admin API, and knows which mode (policy and
    config, see config_of) is in force."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.current = DEFAULT_POLICY
        self.available: bool | None = None  # PATCH /api/models exists
        self.registered: list[str] | None = None  # GET /api/policies, when it exists
        self.notes: list[str] = []

    async def probe(self, session: aiohttp.ClientSession) -> None:
        headers = admin_headers(self.fleet)
        async with session.get(f"{self.fleet.router}/api/policies", headers=headers) as resp:
            if resp.status == 200:
                self.registered = list(orjson.loads(await resp.read()))
        async with session.get(f"{self.fleet.router}/api/models/{MODEL}", headers=headers) as r:
            body = await r.read()
            if r.status == 200:
                self.current = orjson.loads(body).get("policy", DEFAULT_POLICY)
                self.available = True
            else:
                self.available = False
                self.notes.append(
                    f"GET /api/models/{MODEL} answered HTTP {r.status}: policy switching is not "
                    f"available, only the default policy ({DEFAULT_POLICY}) is measured"
                )

    async def patch(self, session: aiohttp.ClientSession, mode: str) -> tuple[int, str]:
        url = f"{self.fleet.router}/api/models/{MODEL}"
        body = {"policy": policy_of(mode), "policy_config": config_of(mode)}
        async with session.patch(url, json=body, headers=admin_headers(self.fleet)) as resp:
            return resp.status, (await resp.text())[:300]

    async def wait_applied(self, session: aiohttp.ClientSession, mode: str) -> None:
        url = f"{self.fleet.router}/api/models/{MODEL}"
        want = {"policy": policy_of(mode), "policy_config": config_of(mode)}
        deadline = time.monotonic() + POLICY_POLL_S
        while time.monotonic() < deadline:
            async with session.get(url, headers=admin_headers(self.fleet)) as resp:
                got = orjson.loads(await resp.read()) if resp.status == 200 else {}
                if all(got.get(k, v) == v for k, v in want.items()):
                    break
            await asyncio.sleep(0.1)
        await asyncio.sleep(POLICY_SETTLE_S)  # the router polls its store every 0.25 s

    async def use(self, session: aiohttp.ClientSession, mode: str) -> str | None:
        """Make `mode` the one in force, as a fresh instance; None, or why it is skipped."""
        policy = policy_of(mode)
        if not self.available:
            return None if mode == DEFAULT_POLICY else "policy switching is not available"
        if self.registered is not None and policy not in self.registered:
            return f"not registered (GET /api/policies: {', '.join(self.registered)})"
        if mode == self.current:
            # Same name and config: the router would keep the old instance and what it learnt.
            other = next(
                (p for p in (self.registered or [DEFAULT_POLICY, "round_robin"]) if p != policy),
                None,
            )
            if other is not None:
                status, text = await self.patch(session, other)
                if status == 200:
                    self.current = other
                    await self.wait_applied(session, other)
        if mode != self.current:
            status, text = await self.patch(session, mode)
            if status != 200:
                return f"PATCH answered HTTP {status}: {text}"
            self.current = mode
            await self.wait_applied(session, mode)
        return None


# --------------------------------------------------------------------------- load generator


@dataclass
class Samples:
    ttfts: list[float] = field(default_factory=list)  # seconds
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    error_kinds: Counter[str] = field(default_factory=Counter)
    sent: int = 0

    def fail(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] += 1


@dataclass(frozen=True)
class Outcome:
    ok: bool
    reply: str
    ttft: float
    latency: float
    error: str = ""


async def chat(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> Outcome:
    """One streamed chat completion; the reply text is the concatenated content deltas."""
    t0 = time.perf_counter()
    first = 0.0
    parts: list[str] = []
    done = False
    buf = b""
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            status = resp.status
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        done = True
                        continue
                    choices = orjson.loads(data).get("choices") or [{}]
                    content = (choices[0].get("delta") or {}).get("content")
                    if content:
                        if not first:
                            first = time.perf_counter()
                        parts.append(content)
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        return Outcome(False, "".join(parts), 0.0, 0.0, type(exc).__name__)
    latency = time.perf_counter() - t0
    if status != 200:
        return Outcome(False, "", 0.0, latency, f"HTTP {status}")
    if not first or not done:
        return Outcome(False, "".join(parts), 0.0, latency, "incomplete stream")
    return Outcome(True, "".join(parts), first - t0, latency)


Picker = Callable[[Session], str]  # chooses the base URL for a session's next request


def request_body(session: Session, messages: list[dict[str, str]]) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "user": session.key,
        }
    )


async def run_sessions(
    workload: Workload,
    pick: Picker,
    concurrency: int,
    tag: str,
    on_request: Callable[[str, Session, int, float], None] | None = None,
    on_done: Callable[[str, Outcome], None] | None = None,
    think_s: float = 0.0,
) -> tuple[Samples, float]:
    """All sessions live at once, at most `concurrency` requests in flight; each session's
    turns are sequential (turn k+1 is sent `think_s` after turn k's answer is read to the
    end)."""
    out = Samples()
    sem = asyncio.Semaphore(concurrency)
    counter = iter(range(10**9))
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def one_session(http: aiohttp.ClientSession, s: Session) -> None:
        messages: list[dict[str, str]] = []
        if s.system is not None:
            messages.append({"role": "system", "content": s.system})
        for k, turn in enumerate(s.turns):
            messages.append({"role": "user", "content": turn})
            body = request_body(s, messages)
            async with sem:
                rid = f"{tag}-{next(counter)}"
                headers = {**JSON_HEADERS, "X-Session-ID": s.key, "X-Request-Id": rid}
                base = pick(s)
                out.sent += 1
                if on_request is not None:
                    on_request(rid, s, k, time.monotonic())
                result = await chat(http, base + "/v1/chat/completions", body, headers)
            if on_done is not None:
                on_done(rid, result)
            if result.ok:
                out.ttfts.append(result.ttft)
                out.latencies.append(result.latency)
            else:
                out.fail(result.error)
            messages.append({"role": "assistant", "content": result.reply})
            if think_s and k + 1 < len(s.turns):
                await asyncio.sleep(think_s)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_session(http, s) for s in workload.sessions))
        wall = time.perf_counter() - t0
    return out, wall


# --------------------------------------------------------------------------- one run


@dataclass
class Measured:
    """The raw outcome of one run (one workload, one mode, one round)."""

    samples: Samples
    wall_s: float
    hits: float
    queries: float
    per_worker: list[int]
    decisions: dict[str, float]
    router_cpu_s: float
    machine_busy_pct: float
    other_busy_pct: float
    cpu_by_group_s: dict[str, float]


@dataclass
class RunResult:
    workload: str
    mode: str  # a policy name or a baseline
    kind: str  # "router", "client" or "floor"
    rounds: int
    requests: int
    ok: int
    errors: int
    error_kinds: dict[str, int]
    wall_s: float
    rps: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    hit_rate: float
    hit_tokens: float
    query_tokens: float
    per_worker: list[int]
    max_worker_share: float
    decisions: dict[str, float]
    policy_seen: list[str]
    router_cpu_ms_per_req: float
    machine_busy_pct: float  # mean over rounds
    other_busy_pct_max: float  # worst round
    cpu_ms_per_req: dict[str, float]  # by process group, over all rounds


def summarize(workload: str, mode: str, runs: list[Measured]) -> RunResult:
    """Pooled over rounds: every TTFT sample, summed counters, throughput = all successful
    requests / all wall time."""
    ttft = [x * 1000 for m in runs for x in m.samples.ttfts]
    lat = [x * 1000 for m in runs for x in m.samples.latencies]
    wall = sum(m.wall_s for m in runs)
    hits = sum(m.hits for m in runs)
    queries = sum(m.queries for m in runs)
    per_worker = [sum(col) for col in zip(*(m.per_worker for m in runs), strict=True)]
    decisions: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for m in runs:
        decisions.update(m.decisions)
        kinds.update(m.samples.error_kinds)
    return RunResult(
        workload=workload,
        mode=mode,
        kind="client" if mode in BASELINES else "floor" if mode in FLOOR_MODES else "router",
        rounds=len(runs),
        requests=sum(m.samples.sent for m in runs),
        ok=len(ttft),
        errors=sum(m.samples.errors for m in runs),
        error_kinds=dict(kinds),
        wall_s=wall,
        rps=len(ttft) / wall if wall else math.nan,
        ttft_mean_ms=statistics.fmean(ttft) if ttft else math.nan,
        ttft_p50_ms=oh.percentile(ttft, 50),
        ttft_p99_ms=oh.percentile(ttft, 99),
        latency_p50_ms=oh.percentile(lat, 50),
        latency_p99_ms=oh.percentile(lat, 99),
        hit_rate=hits / queries if queries else math.nan,
        hit_tokens=hits,
        query_tokens=queries,
        per_worker=per_worker,
        max_worker_share=max(per_worker) / max(sum(per_worker), 1),
        decisions=dict(decisions),
        policy_seen=sorted({k.split(":", 1)[0] for k in decisions}),
        router_cpu_ms_per_req=1000
        * sum(m.router_cpu_s for m in runs)
        / max(sum(m.samples.sent for m in runs), 1),
        machine_busy_pct=statistics.fmean(m.machine_busy_pct for m in runs),
        other_busy_pct_max=max(m.other_busy_pct for m in runs),
        cpu_ms_per_req={
            group: 1000
            * sum(m.cpu_by_group_s.get(group, 0.0) for m in runs)
            / max(sum(m.samples.sent for m in runs), 1)
            for group in runs[0].cpu_by_group_s
        },
    )


def pickers(fleet: Fleet) -> dict[str, Picker]:
    rr = iter(range(10**9))
    return {
        "client_rr": lambda s: fleet.workers[next(rr) % N_WORKERS],
        "client_oracle": lambda s: fleet.workers[s.group % N_WORKERS],
        "floor_oracle": lambda s: f"{fleet.floor}{FLOOR_PIN}{s.group % N_WORKERS}",
    }


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


async def run_one(
    http: aiohttp.ClientSession, fleet: Fleet, workload: Workload, mode: str, tag: str
) -> Measured:
    """One run from cold caches: reset, counters before, the workload, counters after."""
    await reset_workers(http, fleet)
    router = mode not in DIRECT_MODES
    pick: Picker = (lambda s: fleet.router) if router else pickers(fleet)[mode]
    proxy_pid = fleet.floor_pid if mode in FLOOR_MODES else fleet.router_pid
    before = await read_fleet(http, fleet)
    decisions_before = await router_decisions(http, fleet) if router else {}
    revive_celery(fleet)
    fleet.proc.check_alive()
    cpu_before = CpuMark.take(fleet, proxy_pid)
    samples, wall = await run_sessions(workload, pick, CONCURRENCY, tag)
    cpu_after = CpuMark.take(fleet, proxy_pid)
    router_cpu, machine_busy, other_busy, by_group = cpu_figures(cpu_before, cpu_after)
    after = await read_fleet(http, fleet)
    decisions_after = await router_decisions(http, fleet) if router else {}
    pairs = list(zip(after, before, strict=True))
    decisions = {
        f"{p}:{d}": v - decisions_before.get((p, d), 0.0)
        for (p, d), v in decisions_after.items()
        if v - decisions_before.get((p, d), 0.0) > 0
    }
    return Measured(
        samples=samples,
        wall_s=wall,
        hits=sum(a.hits - b.hits for a, b in pairs),
        queries=sum(a.queries - b.queries for a, b in pairs),
        per_worker=[a.received - b.received for a, b in pairs],
        decisions=decisions,
        router_cpu_s=router_cpu,
        machine_busy_pct=machine_busy,
        other_busy_pct=other_busy,
        cpu_by_group_s=by_group,
    )


# --------------------------------------------------------------------------- affinity phase


@dataclass
class AffinityLog:
    """Which worker served which request, learnt from the workers' request logs."""

    sent: dict[str, tuple[str, int, float]] = field(default_factory=dict)  # rid -> (key, k, t)
    served_by: dict[str, int] = field(default_factory=dict)  # rid -> worker index
    failed: dict[str, str] = field(default_factory=dict)
    possibly_missed: int = 0  # a poll found a full log window of unseen entries

    def record(self, rid: str, s: Session, k: int, t: float) -> None:
        self.sent[rid] = (s.key, k, t)

    def done(self, rid: str, result: Outcome) -> None:
        if not result.ok:
            self.failed[rid] = result.error


async def poll_request_logs(
    http: aiohttp.ClientSession, fleet: Fleet, alog: AffinityLog, tag: str, stop: asyncio.Event
) -> None:
    """Every AFFINITY_POLL_S read each worker's last 50 logged requests; bounded by `stop`
    and a deadline."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        final = stop.is_set()
        for index, url in enumerate(fleet.workers):
            async with http.get(url + "/sim/stats") as resp:
                entries = orjson.loads(await resp.read())["requests"]
            unseen = 0
            for entry in entries:
                headers = {k.lower(): v for k, v in entry["headers"].items()}
                rid = headers.get("x-request-id", "")
                if entry["path"] == "/v1/chat/completions" and rid.startswith(tag):
                    if rid not in alog.served_by:
                        unseen += 1
                    alog.served_by[rid] = index
            if unseen >= SIM_LOG_WINDOW:
                alog.possibly_missed += 1
        if final:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), AFFINITY_POLL_S)


async def routable(http: aiohttp.ClientSession, fleet: Fleet, worker_id: int) -> bool:
    async with http.get(fleet.router + "/list_workers") as resp:
        workers = orjson.loads(await resp.read())["workers"]
    return any(w["id"] == worker_id and w["routable"] for w in workers)


async def worker_state(http: aiohttp.ClientSession, fleet: Fleet, worker_id: int) -> str:
    url = f"{fleet.router}/api/workers/{worker_id}"
    async with http.get(url, headers=admin_headers(fleet)) as resp:
        return str(orjson.loads(await resp.read()).get("state", "?"))


def home_workers(
    alog: AffinityLog, rids: list[str]
) -> tuple[dict[str, Counter[int]], dict[str, int]]:
    """Per session: how many of the given requests each worker served, and the most used."""
    per: dict[str, Counter[int]] = {}
    for rid in rids:
        if rid in alog.served_by:
            per.setdefault(alog.sent[rid][0], Counter())[alog.served_by[rid]] += 1
    homes = {key: c.most_common(1)[0][0] for key, c in per.items()}
    return per, homes


async def affinity_phase(
    http: aiohttp.ClientSession, fleet: Fleet, workload: Workload
) -> dict[str, Any]:
    """Stickiness while all workers are healthy, then a drain halfway through."""
    await reset_workers(http, fleet)
    tag = "aff"
    alog = AffinityLog()
    total = workload.requests
    completed = 0
    drain: dict[str, Any] = {}
    drain_started = asyncio.Event()

    def on_done(rid: str, result: Outcome) -> None:
        nonlocal completed
        completed += 1
        alog.done(rid, result)
        if completed >= total // 2 and not drain_started.is_set():
            drain_started.set()

    async def drainer() -> None:
        await drain_started.wait()
        # The worker that is home to most sessions so far.
        _, homes = home_workers(alog, list(alog.sent))
        victim = Counter(homes.values()).most_common(1)[0][0] if homes else 0
        worker_id = fleet.worker_ids[victim]
        drain["victim"] = victim
        drain["worker_id"] = worker_id
        drain["t_request"] = time.monotonic()
        url = f"{fleet.router}/api/workers/{worker_id}/drain"
        async with http.post(url, headers=admin_headers(fleet)) as resp:
            drain["drain_status"] = resp.status
            drain["state_after_post"] = orjson.loads(await resp.read()).get("state")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and await routable(http, fleet, worker_id):
            await asyncio.sleep(0.02)
        drain["t_effective"] = time.monotonic()
        drain["effective_after_s"] = drain["t_effective"] - drain["t_request"]

    stop = asyncio.Event()
    poller = asyncio.create_task(poll_request_logs(http, fleet, alog, tag, stop))
    drain_task = asyncio.create_task(drainer())
    try:
        samples, wall = await run_sessions(
            workload,
            lambda s: fleet.router,
            AFFINITY_CONCURRENCY,
            tag,
            alog.record,
            on_done,
            think_s=AFFINITY_THINK_S,
        )
        await asyncio.wait_for(drain_task, 30)
    finally:
        drain_task.cancel()
        stop.set()
        await asyncio.wait_for(poller, 30)
    worker_id = drain.get("worker_id")
    if worker_id is not None:
        deadline = time.monotonic() + 15
        state = await worker_state(http, fleet, worker_id)
        while state == "draining" and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            state = await worker_state(http, fleet, worker_id)
        drain["state_after_phase"] = state
        drain["drained_after_s"] = time.monotonic() - drain["t_request"]
        url = f"{fleet.router}/api/workers/{worker_id}/activate"
        async with http.post(url, headers=admin_headers(fleet)) as resp:
            drain["activate_status"] = resp.status
        await oh.wait_until(
            "the drained worker to be routable again",
            partial(routable, http, fleet, worker_id),
            fleet.proc,
            timeout=15,
        )
        drain["state_after_activate"] = await worker_state(http, fleet, worker_id)
    return summarize_affinity(alog, samples, wall, drain)


def summarize_affinity(
    alog: AffinityLog, samples: Samples, wall: float, drain: dict[str, Any]
) -> dict[str, Any]:
    t_req = drain.get("t_request", math.inf)
    t_eff = drain.get("t_effective", math.inf)
    victim = drain.get("victim", -1)
    healthy = [rid for rid, (_, _, t) in alog.sent.items() if t < t_req]
    after = [rid for rid, (_, _, t) in alog.sent.items() if t >= t_eff]
    per_healthy, homes = home_workers(alog, healthy)
    on_home = sum(c.most_common(1)[0][1] for c in per_healthy.values())
    attributed_healthy = sum(sum(c.values()) for c in per_healthy.values())
    per_after, new_homes = home_workers(alog, after)
    leaked = sum(1 for rid in after if alog.served_by.get(rid) == victim)
    moved = [k for k, h in homes.items() if h == victim and k in per_after]
    moved_sticky = sum(per_after[k].most_common(1)[0][1] for k in moved)
    moved_total = sum(sum(per_after[k].values()) for k in moved)
    stayed = [k for k, h in homes.items() if h != victim and k in per_after]
    stayed_home = sum(per_after[k][homes[k]] for k in stayed)
    stayed_total = sum(sum(per_after[k].values()) for k in stayed)
    transition = [rid for rid, (_, _, t) in alog.sent.items() if t_req <= t < t_eff]
    return {
        "requests": samples.sent,
        "errors": samples.errors,
        "error_kinds": dict(samples.error_kinds),
        "wall_s": wall,
        "attributed": len(alog.served_by),
        "possibly_missed_polls": alog.possibly_missed,
        "healthy_requests": len(healthy),
        "healthy_attributed": attributed_healthy,
        "healthy_sticky_share": on_home / attributed_healthy if attributed_healthy else math.nan,
        "healthy_fully_sticky_sessions": sum(1 for c in per_healthy.values() if len(c) == 1),
        "sessions": len(per_healthy),
        "sessions_per_home": dict(Counter(homes.values())),
        "drain": {k: v for k, v in drain.items() if not k.startswith("t_")},
        "transition_requests": len(transition),
        "transition_on_drained": sum(1 for r in transition if alog.served_by.get(r) == victim),
        "after_drain_requests": len(after),
        "after_drain_on_drained": leaked,
        "moved_sessions": len(moved),
        "moved_sticky_share": moved_sticky / moved_total if moved_total else math.nan,
        "other_sessions": len(stayed),
        "other_stayed_share": stayed_home / stayed_total if stayed_total else math.nan,
        "sessions_per_home_after": dict(Counter(new_homes.values())),
    }


# --------------------------------------------------------------------------- the benchmark


async def warm_up(http: aiohttp.ClientSession, fleet: Fleet) -> None:
    """A few short requests on every path, so no measured run pays for connection set-up."""
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2,
         "stream": True}
    )  # fmt: skip
    for base in [*fleet.workers, fleet.router, fleet.router]:
        result = await chat(http, base + "/v1/chat/completions", body, JSON_HEADERS)
        if not result.ok:
            raise RuntimeError(f"warm-up request to {base} failed: {result.error}")


async def benchmark(args: argparse.Namespace, proc: oh.Fleet) -> dict[str, Any]:
    scale = QUICK if args.quick else FULL
    workloads = build_workloads(scale, SEED)
    ws = working_set(workloads["prefix"])
    for line in sizing_lines(ws):
        log(line)
    log(f"starting {N_WORKERS} simulated workers and the router ...")
    fleet = await start_fleet(proc, ws["cache_blocks_per_worker"])
    results: list[RunResult] = []
    details: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    affinity: dict[str, Any] | None = None
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await warm_up(http, fleet)
        switch = PolicySwitch(fleet)
        await switch.probe(http)
        log(
            f"policy API: {'available' if switch.available else 'NOT available'}; registered: "
            f"{', '.join(switch.registered) if switch.registered is not None else 'unknown'}; "
            f"in force: {switch.current}"
        )
        names = [w for w in WORKLOADS if args.only_workload in (None, w)]
        for name in names:
            workload = workloads[name]
            log(f"workload {name}: {workload.requests} requests ({workload.description})")
            modes = [*DIRECT_MODES, *args.policies]
            measured: dict[str, list[Measured]] = {m: [] for m in modes}
            for r in range(args.rounds):
                k = r % len(modes)
                for mode in modes[k:] + modes[:k]:  # rotate the order from round to round
                    if mode in skipped:
                        continue
                    if mode not in DIRECT_MODES:
                        why = await switch.use(http, mode)
                        if why is not None:
                            skipped[mode] = why
                            log(f"  {mode:<16} skipped: {why}")
                            continue
                    run = await run_one(http, fleet, workload, mode, f"{name}-{mode}-{r}")
                    measured[mode].append(run)
                    one = summarize(name, mode, [run])
                    details.append({"round": r, **asdict(one)})
                    log(
                        f"  r{r + 1} {mode:<16} TTFT mean {one.ttft_mean_ms:6.1f} p99 "
                        f"{one.ttft_p99_ms:6.1f} ms | {one.rps:6.1f} req/s | hit "
                        f"{one.hit_rate:.3f} | per worker {one.per_worker} | errors "
                        f"{one.errors} | {one.wall_s:.1f} s"
                    )
            results += [summarize(name, m, runs) for m, runs in measured.items() if runs]
        if "session_affinity" in args.policies and "session_affinity" not in skipped:
            why = await switch.use(http, "session_affinity")
            if why is None:
                workload = affinity_workload(scale, SEED)
                log(f"session affinity phase: {workload.description}; drain halfway")
                affinity = await affinity_phase(http, fleet, workload)
                log(f"  {json.dumps(affinity, default=str)}")
            else:
                skipped["session_affinity"] = why
    return {
        "working_set": ws,
        "runs": [asdict(r) for r in results],
        "rounds_detail": details,
        "skipped": skipped,
        "policy_api_notes": switch.notes,
        "celery_restarts": CELERY_RESTARTS,
        "registered_policies": switch.registered,
        "affinity": affinity,
    }


# --------------------------------------------------------------------------- report


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def mark(ok: bool | None) -> str:
    return "n/a" if ok is None else "PASS" if ok else "FAIL"


def find(runs: list[dict[str, Any]], workload: str, mode: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["workload"] == workload and r["mode"] == mode), None)


KIND_NOTES = {
    "client": " (baseline, no router)",
    "floor": " (the oracle's assignment through the floor proxy)",
}


def workload_table(runs: list[dict[str, Any]], workload: str) -> list[str]:
    lines = [
        "| mode | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | req/s | prefix hit rate "
        "| requests per worker | errors | proxy CPU ms/req | policy decisions |",
        "|---|--:|--:|--:|--:|--:|---|--:|--:|---|",
    ]
    for r in runs:
        if r["workload"] != workload:
            continue
        label = r["mode"] + KIND_NOTES.get(r["kind"], "")
        decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["decisions"].items())) or "-"
        lines.append(
            f"| {label} | {fmt(r['ttft_mean_ms'])} | {fmt(r['ttft_p50_ms'])} "
            f"| {fmt(r['ttft_p99_ms'])} | {fmt(r['rps'])} | {fmt(r['hit_rate'], 3)} "
            f"| {' / '.join(str(n) for n in r['per_worker'])} | {r['errors']} "
            f"| {fmt(r['router_cpu_ms_per_req'], 2) if r['kind'] != 'client' else '-'} "
            f"| {decisions} |"
        )
    return lines


def per_round(
    details: list[dict[str, Any]], workload: str, mode: str, key: str
) -> dict[int, float]:
    """round -> `key` of one mode's run in that round."""
    return {d["round"]: d[key] for d in details if d["workload"] == workload and d["mode"] == mode}


def round_ratios(
    details: list[dict[str, Any]], workload: str, mode: str, base: str, key: str
) -> list[float]:
    """`key` of `mode` over `base`'s, per round (both ran in it, minutes apart at most)."""
    a, b = per_round(details, workload, mode, key), per_round(details, workload, base, key)
    return [a[r] / b[r] for r in sorted(a) if b.get(r)]


def ratio_row(
    label: str, result: dict[str, Any], workload: str, mode: str, base: str, key: str,
    limit: float, higher_is_better: bool = False,
) -> tuple[str, str, str, bool | None]:  # fmt: skip
    """A target on the median over rounds of the per-round ratio (the pooled figures are
    shown too); per-round ratios cancel the drift of a shared machine between rounds."""
    ratios = round_ratios(result["rounds_detail"], workload, mode, base, key)
    value, ref = find(result["runs"], workload, mode), find(result["runs"], workload, base)
    if not ratios or value is None or ref is None:
        return label, "not measured", "", None
    ratio = statistics.median(ratios)
    measured = (
        f"median {ratio:.2f}x ({' / '.join(f'{x:.2f}' for x in ratios)}); pooled "
        f"{value[key]:.1f} vs {ref[key]:.1f}"
    )
    if higher_is_better:
        return label, measured, f">= {limit:.2f}x", ratio >= limit
    return label, measured, f"<= {limit:.2f}x", ratio <= limit


def target_rows(result: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    rows: list[tuple[str, str, str, bool | None]] = []
    hits = per_round(result["rounds_detail"], "prefix", "prefix_aware", "hit_rate")
    if not hits:
        rows.append(("prefix: prefix_aware hit rate", "not measured", "", None))
    else:
        hit = statistics.median(hits.values())
        rows.append(
            ("prefix: prefix_aware hit rate", f"median {hit:.3f} "
             f"({' / '.join(f'{x:.3f}' for x in hits.values())})", f">= {HIT_RATE_TARGET}",
             hit >= HIT_RATE_TARGET)
        )  # fmt: skip
    pa, sq = "prefix_aware", "shortest_queue"
    rows += [
        ratio_row("prefix: prefix_aware mean TTFT vs client oracle", result, "prefix", pa,
                  "client_oracle", "ttft_mean_ms", TTFT_VS_ORACLE),
        ratio_row("skewed: prefix_aware p99 TTFT vs shortest_queue", result, "skewed", pa, sq,
                  "ttft_p99_ms", SKEW_P99_VS_SQ),
        ratio_row("uniform: prefix_aware throughput vs shortest_queue", result, "uniform", pa, sq,
                  "rps", 1 - UNIFORM_TOLERANCE, higher_is_better=True),
        ratio_row("uniform: prefix_aware p99 TTFT vs shortest_queue", result, "uniform", pa, sq,
                  "ttft_p99_ms", 1 + UNIFORM_TOLERANCE),
    ]  # fmt: skip
    aff = result["affinity"]
    if aff is None:
        rows.append(("session_affinity: turns on the session's worker", "not measured", "", None))
        rows.append(("session_affinity: drain moves sessions, no errors", "not measured", "", None))
    else:
        share = aff["healthy_sticky_share"]
        rows.append(
            ("session_affinity: turns on the session's worker (all healthy)",
             f"{share:.3f} ({aff['healthy_fully_sticky_sessions']}/{aff['sessions']} sessions "
             "fully)", f">= {STICKY_TARGET}", share >= STICKY_TARGET)
        )  # fmt: skip
        ok = (
            aff["errors"] == 0
            and aff["after_drain_on_drained"] == 0
            and aff["drain"].get("drain_status") == 200
            and aff["moved_sessions"] > 0
        )
        rows.append(
            ("session_affinity: drain moves sessions, no errors",
             f"{aff['errors']} errors, {aff['after_drain_on_drained']} requests on the drained "
             f"worker after the router stopped routing to it, {aff['moved_sessions']} sessions "
             "moved", "0 errors, 0 on drained", ok)
        )  # fmt: skip
    return rows


def hop_lines(result: dict[str, Any]) -> list[str]:
    """What the extra hop costs on this machine, to read the router-vs-oracle target by."""
    runs, details = result["runs"], result["rounds_detail"]
    lines = []
    via, direct = find(runs, "uniform", "round_robin"), find(runs, "uniform", "client_rr")
    if via is not None and direct is not None:
        lines.append(
            "* Router hop (uniform, round_robin through the router vs client_rr straight to "
            f"the workers, same assignment): TTFT mean {fmt(via['ttft_mean_ms'])} vs "
            f"{fmt(direct['ttft_mean_ms'])} ms "
            f"({via['ttft_mean_ms'] - direct['ttft_mean_ms']:+.1f} ms), throughput "
            f"{fmt(via['rps'])} vs {fmt(direct['rps'])} req/s ({via['rps'] / direct['rps']:.2f}x)."
        )
    for mode in ("floor_oracle", "prefix_aware"):
        ratios = round_ratios(details, "prefix", mode, "client_oracle", "ttft_mean_ms")
        row = find(runs, "prefix", mode)
        oracle = find(runs, "prefix", "client_oracle")
        if not ratios or row is None or oracle is None:
            continue
        what = (
            "the oracle's assignment through the floor proxy (uvicorn + aiohttp, no routing)"
            if mode == "floor_oracle"
            else "prefix_aware through the router"
        )
        lines.append(
            f"* prefix, {what} vs the client oracle: TTFT mean {fmt(row['ttft_mean_ms'])} vs "
            f"{fmt(oracle['ttft_mean_ms'])} ms pooled "
            f"({row['ttft_mean_ms'] - oracle['ttft_mean_ms']:+.1f} ms), median per-round ratio "
            f"{statistics.median(ratios):.2f}x ({' / '.join(f'{x:.2f}' for x in ratios)})."
        )
    if lines:
        lines.append(
            f"* The proxies share the {len(os.sched_getaffinity(0))} CPUs with the workers and "
            "the load generator, so these include CPU contention. If the floor proxy alone "
            f"exceeds {TTFT_VS_ORACLE:.2f}x the client oracle, no proxy on this stack can meet "
            "the mean-TTFT target on this machine, whatever it routes."
        )
    return lines


def cpu_table(result: dict[str, Any]) -> list[str]:
    """Where the CPU goes on `prefix`, per request, by process group (pooled rounds)."""
    runs = [r for r in result["runs"] if r["workload"] == "prefix"]
    groups = ["load generator", "workers", "router", "floor", "celery"]
    lines = [
        "CPU per request on `prefix` by process (ms; the machine has "
        f"{len(os.sched_getaffinity(0))} CPUs, so 1 s of wall time holds "
        f"{len(os.sched_getaffinity(0)) * 1000} ms):",
        "",
        f"| mode | {' | '.join(groups)} | all | machine busy % |",
        f"|---|{'--:|' * (len(groups) + 2)}",
    ]
    for r in runs:
        cpu = r["cpu_ms_per_req"]
        cells = " | ".join(fmt(cpu.get(g), 2) for g in groups)
        lines.append(
            f"| {r['mode']} | {cells} | {fmt(sum(cpu.values()), 2)} "
            f"| {fmt(r['machine_busy_pct'], 0)} |"
        )
    return lines


def affinity_lines(aff: dict[str, Any]) -> list[str]:
    d = aff["drain"]
    return [
        f"Session affinity phase: {aff['requests']} requests, {aff['errors']} errors "
        f"({aff['attributed']} attributed to a worker through the request logs, "
        f"{aff['possibly_missed_polls']} polls that may have missed some).",
        f"* healthy: {aff['healthy_attributed']} requests of {aff['sessions']} sessions; "
        f"{fmt(aff['healthy_sticky_share'], 3)} of them on their session's usual worker; "
        f"{aff['healthy_fully_sticky_sessions']} sessions entirely on one worker; sessions per "
        f"worker {aff['sessions_per_home']}.",
        f"* drain of worker {d.get('victim')} (id {d.get('worker_id')}): HTTP "
        f"{d.get('drain_status')}, state {d.get('state_after_post')} -> "
        f"{d.get('state_after_phase')} {fmt(d.get('drained_after_s'))} s after the request "
        "(once the router reported nothing in flight on it); the router stopped routing to it "
        f"{fmt(d.get('effective_after_s', math.nan) * 1000, 0)} ms after the request; "
        f"{aff['transition_requests']} requests were sent in between "
        f"({aff['transition_on_drained']} of them still went to it).",
        f"* after the drain: {aff['after_drain_requests']} requests, "
        f"{aff['after_drain_on_drained']} on the drained worker; its {aff['moved_sessions']} "
        f"sessions moved and kept {fmt(aff['moved_sticky_share'], 3)} of their later turns on "
        f"one new worker; the other {aff['other_sessions']} sessions kept "
        f"{fmt(aff['other_stayed_share'], 3)} of theirs on their old worker; sessions per worker "
        f"{aff['sessions_per_home_after']}.",
        f"* activate: HTTP {d.get('activate_status')}, state {d.get('state_after_activate')}.",
    ]


def report(result: dict[str, Any]) -> str:
    m, cfg = result["machine"], result["config"]
    lines = [
        f"## Routing policies — {m['date']}",
        "",
        f"Machine: nproc {m['nproc']}, {m['cpu_model']}, Python {m['python']}, kernel "
        f"{m['kernel']}. {N_WORKERS} simulated workers (--ttft-ms {TTFT_MS:g} "
        f"--prefill-ms-per-block {PREFILL_MS_PER_BLOCK:g} --itl-ms {ITL_MS:g} --max-batch "
        f"{MAX_BATCH} --block-size {BLOCK_SIZE} --cache-blocks "
        f"{result['working_set']['cache_blocks_per_worker']}); streamed chat completions, "
        f"max_tokens {MAX_TOKENS}, at most {CONCURRENCY} in flight; seed {SEED}; every run "
        f"starts with cold caches; {cfg['rounds']} run(s) per workload and mode, figures "
        f"pooled over them{', quick mode' if cfg['quick'] else ''}; health probes every "
        f"{PROBE_INTERVAL_S:g} s. "
        f"Duration {result['duration_s']} s.",
        "",
        *sizing_lines(result["working_set"]),
    ]
    for name in WORKLOADS:
        if not any(r["workload"] == name for r in result["runs"]):
            continue
        desc = result["workloads"][name]
        lines += ["", f"### `{name}`: {desc}", "", *workload_table(result["runs"], name)]
    lines += ["", "### Targets", "", "| target | measured | limit | result |", "|---|---|--:|:-:|"]
    for label, value, limit, ok in target_rows(result):
        lines.append(f"| {label} | {value} | {limit} | {mark(ok)} |")
    hop = hop_lines(result)
    if hop:
        lines += ["", "What the hop costs on this machine:", "", *hop, "", *cpu_table(result)]
    if result["affinity"] is not None:
        lines += ["", *affinity_lines(result["affinity"])]
    lines += [
        "",
        "Reference figures from the issue (prefix workload; measured by the issue author on the "
        "same workload, not rerun here):",
        "",
        "| router | hit rate | mean TTFT |",
        "|---|--:|--:|",
        *(f"| {name} | {hit} | {ttft} |" for name, hit, ttft in PEER_FIGURES),
    ]
    notes = [f"{p} skipped: {why}" for p, why in result["skipped"].items()]
    notes += result["policy_api_notes"]
    notes += [f"the Celery worker died and was restarted: {r}" for r in result["celery_restarts"]]
    for r in result["runs"]:
        seen = r["policy_seen"]
        if r["kind"] == "router" and seen and seen != [policy_of(r["mode"])]:
            notes.append(
                f"{r['workload']}/{r['mode']}: the router's decision counters name "
                f"{', '.join(r['policy_seen'])}"
            )
        if r["errors"]:
            notes.append(f"{r['workload']}/{r['mode']}: {r['errors']} errors {r['error_kinds']}")
    details = result["rounds_detail"]
    noisy = [d for d in details if d["other_busy_pct_max"] > OTHER_LOAD_WARN_PCT]
    if noisy:
        worst = max(d["other_busy_pct_max"] for d in noisy)
        notes.append(
            f"WARNING: processes outside this benchmark kept the CPUs more than "
            f"{OTHER_LOAD_WARN_PCT:.0f} % busy during {len(noisy)} of {len(details)} runs (up "
            f"to {worst:.0f} %); those figures are unreliable, rerun on a quiet machine "
            "(per-run figures in the JSON: other_busy_pct_max)"
        )
    if notes:
        lines += ["", "Notes:", "", *(f"* {n}" for n in notes)]
    return "\n".join(lines)


def write_json(result: dict[str, Any]) -> str:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = OUT_DIR / f"routing-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Compare the routing policies (and client-side baselines) on seeded workloads."
    )
    parser.add_argument("--quick", action="store_true", help="smaller workloads: a smoke run")
    parser.add_argument("--only-workload", choices=WORKLOADS, help="run just this workload")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"runs per workload and mode, pooled (default {DEFAULT_ROUNDS}, 1 with --quick)",
    )
    parser.add_argument(
        "--policies",
        default=",".join(ALL_POLICIES),
        help=f"comma-separated router policies (default: {','.join(ALL_POLICIES)})",
    )
    parser.add_argument(
        "--prefill-ms-per-block",
        type=float,
        default=PREFILL_MS_PER_BLOCK,
        help=f"simulated prefill cost per uncached block (default {PREFILL_MS_PER_BLOCK:g})",
    )
    parser.add_argument(
        "--prefix-config",
        type=json.loads,
        default=POLICY_CONFIGS["prefix_aware"],
        help="prefix_aware's policy_config as JSON "
        f"(default {json.dumps(POLICY_CONFIGS['prefix_aware'])})",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.prefill_ms_per_block <= 100:
        parser.error("--prefill-ms-per-block must be between 0 and 100")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in ALL_POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; known: {', '.join(ALL_POLICIES)}")
    args.policies = list(dict.fromkeys(policies))
    if args.rounds is None:
        args.rounds = 1 if args.quick else DEFAULT_ROUNDS
    if not 1 <= args.rounds <= 10:
        parser.error("--rounds must be between 1 and 10")
    return args


def main(argv: list[str] | None = None) -> int:
    global PREFILL_MS_PER_BLOCK
    args = parse_args(argv)
    PREFILL_MS_PER_BLOCK = args.prefill_ms_per_block
    POLICY_CONFIGS["prefix_aware"] = args.prefix_config
    proc = oh.Fleet()
    atexit.register(proc.stop)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    try:
        result = oh.run_async(benchmark(args, proc))
    except KeyboardInterrupt:
        log("interrupted; stopping subprocesses")
        return 130
    finally:
        proc.stop()
    scale = QUICK if args.quick else FULL
    result = {
        "machine": oh.machine_info(),
        "config": {
            "quick": args.quick,
            "only_workload": args.only_workload,
            "rounds": args.rounds,
            "policies": args.policies,
            "scale": asdict(scale),
            "seed": SEED,
            "concurrency": CONCURRENCY,
            "max_tokens": MAX_TOKENS,
            "simulator": {
                "ttft_ms": TTFT_MS,
                "prefill_ms_per_block": PREFILL_MS_PER_BLOCK,
                "itl_ms": ITL_MS,
                "max_batch": MAX_BATCH,
                "block_size": BLOCK_SIZE,
            },
            "python": PYTHON,
        },
        "workloads": {n: w.description for n, w in build_workloads(scale, SEED).items()},
        "duration_s": round(time.monotonic() - started, 1),
        **result,
    }
    print(report(result))
    path = write_json(result)
    log(f"\nwrote {path} ({result['duration_s']} s)")
    errors = sum(r["errors"] for r in result["runs"])
    if result["affinity"] is not None:
        errors += result["affinity"]["errors"]
    if errors:
        log(f"WARNING: {errors} requests failed; the figures are suspect")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
