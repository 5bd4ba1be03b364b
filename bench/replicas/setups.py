"""The set-ups of ``bench.replicas``: the bench database, Redis, haproxy, and the routers.

A library for that script, not a script:

* **Services** (harness/databases.py): a fresh PostgreSQL database on the server of
  ``--pg-url``, dropped at the end, and the run's own Redis db number (``--redis-db``, 9 by
  default), emptied at the start and at the end, so a run never touches other data.
* **haproxy** from Debian's package: :func:`ensure_haproxy` installs it with apt-get when
  ``/usr/sbin/haproxy`` is missing (root only), :func:`haproxy_config` writes its config
  (round robin over the replicas, ``option http-no-delay``, keep-alive on both sides, long
  timeouts for streams, bound on 127.0.0.1 only); for ``replicas2c`` haproxy in TCP mode
  (layer 4, round robin per connection), so a client's keep-alive connection stays with one
  replica, as a Kubernetes Service (kube-proxy) balances connections rather than requests.
* **Set-ups** (:data:`SETUPS`): one router, one replica with ``manage.py serve --routers 2``
  (when this build has the option), two and three replicas behind haproxy balancing
  requests, two balancing connections (``replicas2c``, not in the default run), the client
  oracle (no router at all), and the floors: the oracle's assignment through one
  bench/common/floor_proxy.py (``floor1``) or two behind the same haproxy (``floor2``), the least
  any router, or pair of routers behind haproxy, can cost on this machine.
  :func:`start_setup` starts one on the shared database, waits until
  every router lists the workers as routable, and :func:`stop_setup` stops it again, so no idle
  router of another set-up takes CPU from a measured one.
* **Policies.** :func:`set_policy` changes the model's policy through one router's
  ``PATCH /api/models/{name}`` and waits until every router process it can address has loaded a
  snapshot newer than the change (``/health``'s ``snapshot_generation``), plus a settle time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.common.floor import start_floor
from bench.common.output import log
from bench.common.router_api import (
    http_ok,
    listed_workers,
    post_ok,
    register_workers,
    snapshot_generation,
)
from bench.routing import fleet as rf
from bench.routing.fleet import MODEL, use_tokenizer, wait_kv_ready, wait_tokenizer_loaded
from harness.fleet import HOST, PYTHON, ROOT, Fleet, wait_ready
from harness.processes import Running, free_ports

HAPROXY = Path("/usr/sbin/haproxy")
STOP_TIMEOUT_S = 15.0
# After every addressable router loaded the change: the processes behind one port (`serve
# --routers N`) poll the database every 0.25 s too, and a new policy instance is built on the
# first request.
POLICY_SETTLE_S = 1.0
POLICY_WAIT_S = 8.0

# The router's uvicorn command, as harness/fleet.py's start_router runs it (which also migrates
# on every start; here the database is migrated once, so replicas start without it).
ROUTER_FLAGS = ("--lifespan", "on", "--no-access-log")

ONE, ROUTERS2, REPLICAS2, REPLICAS3, ORACLE = "one", "routers2", "replicas2", "replicas3", "oracle"
REPLICAS2C = "replicas2c"  # haproxy keeps a client connection on one replica
# The oracle's assignment through bench/common/floor_proxy.py: one, or two behind haproxy.
FLOOR1, FLOOR2 = "floor1", "floor2"
FLOORS = (FLOOR1, FLOOR2)
ROUTERLESS = (ORACLE, *FLOORS)  # no router: each workload runs once per round, no policy
SETUPS = (ONE, ROUTERS2, REPLICAS2, REPLICAS3, FLOOR1, FLOOR2, ORACLE)
OPTIONAL_SETUPS = (REPLICAS2C,)  # run only when named with --only
ALL_SETUPS = (*SETUPS[:4], *OPTIONAL_SETUPS, *SETUPS[4:])  # the report's order
LABELS = {
    ONE: "one router",
    ROUTERS2: "one replica, serve --routers 2",
    REPLICAS2: "2 replicas + haproxy",
    REPLICAS3: "3 replicas + haproxy",
    REPLICAS2C: "2 replicas + haproxy per connection",
    FLOOR1: "floor proxy (oracle's assignment)",
    FLOOR2: "2 floor proxies + haproxy (oracle's assignment)",
    ORACLE: "client oracle",
}
MULTI = (ROUTERS2, REPLICAS2, REPLICAS3)


# --------------------------------------------------------------------------- haproxy


def ensure_haproxy() -> str:
    """/usr/sbin/haproxy, installed from Debian's package when missing (root only)."""
    if HAPROXY.exists():
        return _haproxy_version()
    if os.geteuid() != 0:
        raise SystemExit(
            f"{HAPROXY} is missing and this is not root: install Debian's haproxy "
            "(sudo apt-get install haproxy) and run again"
        )
    if shutil.which("apt-get") is None:
        raise SystemExit(f"{HAPROXY} is missing and there is no apt-get to install it with")
    log("haproxy is missing; installing Debian's package ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "haproxy"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, capture_output=True)
        result = subprocess.run(install, env=env, capture_output=True)
        if result.returncode != 0:
            raise SystemExit(f"apt-get install haproxy failed:\n{result.stderr.decode()[-2000:]}")
    if not HAPROXY.exists():
        raise SystemExit(f"apt-get installed haproxy, but {HAPROXY} is still missing")
    return _haproxy_version()


def _haproxy_version() -> str:
    out = subprocess.run([str(HAPROXY), "-v"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else "unknown"


# Keep-alive on both sides, not `option http-server-close`: an LLM gateway's clients (the
# OpenAI SDK's httpx pool) keep their connections, and so should the gateway towards the
# routers, or every request pays a loopback connect and leaves a TIME_WAIT socket, which would
# measure haproxy's configuration rather than the routers. In `mode http` haproxy balances every
# request on its own, kept-alive connection or not, so round robin stays per request.
HAPROXY_CONFIG = """\
global
    maxconn 8192

defaults
    mode {mode}
{http_options}    timeout connect 5s
    timeout client 600s
    timeout server 600s
    timeout queue 30s

frontend routers
    bind {host}:{port}
    default_backend replicas

backend replicas
    balance roundrobin
    option httpchk GET /health
    http-check expect status 200
{servers}
"""
# Layer 7 (per request): no delay on the streams' small writes, keep-alive on both sides.
HTTP_OPTIONS = """\
    option http-no-delay
    option http-keep-alive
    http-reuse safe
    timeout http-request 30s
    timeout http-keep-alive 30s
"""


def haproxy_config(
    port: int, replica_ports: list[int], per_connection: bool = False, check: bool = True
) -> str:
    """`check`: health-check the replicas (GET /health); floor proxies have no /health."""
    checking = " check inter 2s" if check else ""
    servers = "\n".join(
        f"    server r{i} {HOST}:{p}{checking} maxconn 4096" for i, p in enumerate(replica_ports)
    )
    # Layer 4 when per connection: each client connection to one replica, as kube-proxy does.
    mode, options = ("tcp", "") if per_connection else ("http", HTTP_OPTIONS)
    return HAPROXY_CONFIG.format(
        mode=mode, http_options=options, host=HOST, port=port, servers=servers
    )


def start_haproxy(
    proc: Fleet,
    name: str,
    port: int,
    replica_ports: list[int],
    per_connection: bool,
    check: bool = True,
) -> int:
    path = proc.tmp / f"{name}.cfg"
    path.write_text(haproxy_config(port, replica_ports, per_connection, check))
    checked = subprocess.run([str(HAPROXY), "-c", "-q", "-f", str(path)], capture_output=True)
    if checked.returncode != 0:
        raise RuntimeError(f"haproxy rejects {path}:\n{checked.stderr.decode()[-2000:]}")
    return proc.spawn(name, [str(HAPROXY), "-db", "-f", str(path)]).pid


# --------------------------------------------------------------------------- routers


def serve_has_routers(proc: Fleet) -> bool:
    """Whether this build's `manage.py serve` takes --routers."""
    result = subprocess.run(
        [PYTHON, "manage.py", "serve", "--help"],
        cwd=ROOT,
        env=proc.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return "--routers" in result.stdout


def start_replica(proc: Fleet, name: str, port: int) -> int:
    args = [PYTHON, "-m", "uvicorn", "controlpanel.asgi:application", "--host", HOST,
            "--port", str(port), *ROUTER_FLAGS]  # fmt: skip
    return proc.spawn(name, args).pid


def start_serve(proc: Fleet, name: str, port: int, routers: int) -> int:
    args = [PYTHON, "manage.py", "serve", "--routers", str(routers), "--no-celery",
            "--host", HOST, "--port", str(port)]  # fmt: skip
    return proc.spawn(name, args).pid


@dataclass
class Setup:
    """One started set-up: where clients send, which router processes it has."""

    name: str
    front: str  # base URL the clients use (a router, haproxy, or "" for the oracle)
    routers: dict[str, int]  # process name -> pid (the serve supervisor for ROUTERS2)
    router_urls: list[str]  # every router address this benchmark can reach on its own
    haproxy_pid: int | None = None
    procs: list[str] = field(default_factory=list)  # fleet process names, to stop

    @property
    def admin(self) -> str:
        return self.router_urls[0]


async def start_setup(
    proc: Fleet, http: aiohttp.ClientSession, name: str, workers: list[str]
) -> Setup:
    """Start `name`'s processes, and wait until every router routes to all `workers`."""
    if name == ORACLE:
        return Setup(name, "", {}, [])
    if name in FLOORS:
        return await start_floors(proc, http, name, workers)
    n = {ONE: 1, ROUTERS2: 1, REPLICAS2: 2, REPLICAS3: 3, REPLICAS2C: 2}[name]
    ports = free_ports(n + 1)
    routers: dict[str, int] = {}
    for i in range(n):
        pname = f"{name}-r{i}"
        if name == ROUTERS2:
            routers[pname] = start_serve(proc, pname, ports[i], routers=2)
        else:
            routers[pname] = start_replica(proc, pname, ports[i])
    urls = [f"http://{HOST}:{p}" for p in ports[:n]]
    setup = Setup(name, urls[0], routers, urls, procs=list(routers))
    for url in urls:
        await wait_ready(f"{url}/health", partial(http_ok, http, url + "/health"), proc, timeout=90)
    await ensure_registered(http, proc, setup, workers)
    if name in (REPLICAS2, REPLICAS3, REPLICAS2C):
        hname = f"{name}-haproxy"
        setup.haproxy_pid = start_haproxy(proc, hname, ports[n], ports[:n], name == REPLICAS2C)
        setup.procs.append(hname)
        setup.front = f"http://{HOST}:{ports[n]}"
        await wait_ready(
            f"{setup.front} (haproxy)",
            partial(http_ok, http, setup.front + "/health"),
            proc,
        )
    return setup


async def start_floors(
    proc: Fleet, http: aiohttp.ClientSession, name: str, workers: list[str]
) -> Setup:
    """One floor proxy, or two behind haproxy (round robin per request, no health check),
    each forwarding ``/upstream/<i>/...`` to worker i: clients send the oracle's choice."""
    n = 1 if name == FLOOR1 else 2
    ports = free_ports(n + 1)
    pids = {
        f"{name}-r{i}": start_floor(proc, ports[i], {"": workers}, name=f"{name}-r{i}")
        for i in range(n)
    }
    setup = Setup(name, f"http://{HOST}:{ports[0]}", pids, [], procs=list(pids))
    if n > 1:
        hname = f"{name}-haproxy"
        setup.haproxy_pid = start_haproxy(proc, hname, ports[n], ports[:n], False, check=False)
        setup.procs.append(hname)
        setup.front = f"http://{HOST}:{ports[n]}"
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    for url in [f"http://{HOST}:{p}" for p in ports[:n]] + [setup.front]:
        probe = f"{url}/upstream/0/v1/chat/completions"
        await wait_ready(probe, partial(post_ok, http, probe, body), proc)
    return setup


REGISTERED: list[str] = []  # worker URLs registered in the bench database
# More registration fields by worker URL (replicas.py --kv: kv_events, kv_events_replay); with
# them, every router of a set-up must also follow each worker's KV events before it runs.
WORKER_EXTRA: dict[str, dict[str, Any]] = {}
# replicas.py --tokenizer: the folder named as the model's tokenizer (once, after the workers
# are registered); every router of a set-up must have loaded it before it runs.
TOKENIZER: dict[str, str] = {}


async def start_workers(proc: Fleet, cache_blocks: int, kv: bool, tokenizer: str = "") -> rf.Fleet:
    """The four simulated workers (publishing KV events with `kv`, then listed in
    WORKER_EXTRA) and Celery. The routing benchmark's Fleet type carries them (its counters
    read only `workers`); these set-ups have no single router or floor."""
    # One call: ports from separate calls can coincide (each is released before the next).
    every = free_ports(rf.N_WORKERS * (3 if kv else 1))
    ports, kv_ports = every[: rf.N_WORKERS], every[rf.N_WORKERS :]
    pairs = [(kv_ports[2 * i], kv_ports[2 * i + 1]) for i in range(rf.N_WORKERS)] if kv else []
    for i, port in enumerate(ports):
        rf.start_sim(
            proc, f"worker{i}", port, cache_blocks, rf.PREFILL_MS_PER_BLOCK,
            pairs[i] if kv else None, tokenizer,
        )  # fmt: skip
    rf.start_celery(proc)
    urls = [f"http://{HOST}:{p}" for p in ports]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for url in urls:
            await wait_ready(f"{url}/health", partial(http_ok, http, url + "/health"), proc)
    endpoints = [rf.kv_endpoints(p) for p in pairs]
    for url, (events, replay) in zip(urls if kv else [], endpoints, strict=True):
        WORKER_EXTRA[url] = {"kv_events": events, "kv_events_replay": replay}
    return rf.Fleet(proc, "", 0, urls, [], cache_blocks, "", 0, endpoints)


async def ensure_registered(
    http: aiohttp.ClientSession, proc: Fleet, setup: Setup, workers: list[str]
) -> None:
    """Register the workers once, through the set-up's first router; then wait until every
    router of the set-up lists all of them as routable."""
    if not REGISTERED:
        name = next(iter(setup.routers))
        log(f"registering {len(workers)} workers through {setup.admin} ...")
        await register_workers(http, proc, setup.admin, workers, name=name, extra=WORKER_EXTRA)
        REGISTERED.extend(workers)
        if TOKENIZER:
            await use_tokenizer(http, proc, setup.admin, TOKENIZER["folder"])

    async def routable(url: str) -> bool:
        listed = await listed_workers(http, url)
        ok = [w for w in listed if w["routable"] and w["url"].rstrip("/") in workers]
        return len(ok) == len(workers)

    for url in setup.router_urls:
        for _ in range(3 if setup.name == ROUTERS2 else 1):  # one port, several processes
            await wait_ready(
                f"{url} routes to all workers", partial(routable, url), proc, timeout=60
            )
        if WORKER_EXTRA:
            await wait_kv_ready(http, proc, url, workers)
        for _ in range(3 if TOKENIZER and setup.name == ROUTERS2 else 1 if TOKENIZER else 0):
            await wait_tokenizer_loaded(http, proc, url, TOKENIZER["folder"])


def stop_setup(proc: Fleet, setup: Setup) -> None:
    """SIGTERM the set-up's processes (haproxy first), and whatever they started."""
    names = sorted(setup.procs, key=lambda name: not name.endswith("haproxy"))

    def killed(child: Running) -> None:
        log(f"  {child.name} did not stop in {STOP_TIMEOUT_S:g} s; killing it")

    for child in proc.stop_named(names, STOP_TIMEOUT_S, killed):
        # `serve` runs its routers in its own session (start_new_session): end any left.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGTERM)


# --------------------------------------------------------------------------- policies


async def set_policy(
    http: aiohttp.ClientSession,
    proc: Fleet,
    setup: Setup,
    policy: str,
    config: dict[str, Any],
) -> str | None:
    """PATCH the model's policy on the set-up's first router, then wait until every router it
    can address has a newer snapshot, plus POLICY_SETTLE_S; None, or why it failed."""
    before = {u: await snapshot_generation(http, u) for u in setup.router_urls}
    headers = {"Authorization": f"Bearer {proc.token}"}
    body = {"policy": policy, "policy_config": config}
    url = f"{setup.admin}/api/models/{MODEL}"
    async with http.patch(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            return f"PATCH {url}: HTTP {resp.status} {(await resp.text())[:300]}"
        await resp.read()
    deadline = time.monotonic() + POLICY_WAIT_S
    pending = dict(before)
    while pending and time.monotonic() < deadline:
        for u in list(pending):
            if await snapshot_generation(http, u) > pending[u]:
                del pending[u]
        await asyncio.sleep(0.05)
    if pending:
        log(f"  WARNING: {', '.join(pending)} did not reload within {POLICY_WAIT_S:g} s")
    await asyncio.sleep(POLICY_SETTLE_S)
    return None
