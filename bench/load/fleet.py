"""The processes of ``bench.load`` and what it reads from them.

A library for that script, not a script: the fleet's start-up (four simulated workers that
never queue, the router with a backlog for every client, the workers registered through the
admin API), the open-file limits (this process's, raised before anything starts so the
children inherit it, and the router's, read back from ``/proc``), and the router's state after
the run: its sockets by state and peer, its in-flight counter, and the wait until its upstream
pool is empty.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import aiohttp

from bench.common.output import log
from bench.common.router_api import http_ok, listed_workers, register_workers
from harness.fleet import HOST, Fleet, start_router, start_simulated_worker, wait_ready
from harness.processes import free_ports
from harness.procfs import socket_inodes, tcp_table

MODEL = "bench-load"
N_WORKERS = 4
UVICORN_BACKLOG = 2048  # uvicorn's default; raised to --clients when that is larger


# --------------------------------------------------------------------------- limits


def raise_nofile(needed: int) -> dict[str, int]:
    """Raise this process's soft RLIMIT_NOFILE towards `needed` (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = soft if soft >= needed else needed
    if hard != resource.RLIM_INFINITY:
        target = min(target, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log(f"WARNING: open-file limit {target} (hard {hard}) is below the {needed} needed")
    return {"soft_before": soft, "soft": target, "hard": hard, "needed": needed}


def proc_nofile(pid: int) -> int | None:
    """The soft "Max open files" of another process, from /proc/<pid>/limits."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            value = line.split()[3]
            return None if value == "unlimited" else int(value)
    return None


# --------------------------------------------------------------------------- /proc sockets


def router_sockets(pid: int, router_port: int, worker_ports: set[int]) -> dict[str, int]:
    """The router's fds and sockets, its TCP connections by state and by peer."""
    fds, inodes = socket_inodes(pid)
    table = tcp_table(pid)
    counts: Counter[str] = Counter()
    for inode in inodes:
        entry = table.get(inode)
        if entry is None:
            counts["non_tcp"] += 1  # unix sockets, socketpairs (the event loop's self-pipe)
            continue
        local, remote, state = entry
        counts[f"tcp_{state}"] += 1
        if state == "established":
            if local == router_port:
                counts["established_from_clients"] += 1
            elif remote in worker_ports:
                counts["established_to_workers"] += 1
            else:
                counts["established_other"] += 1
    return {
        "fds": fds,
        "sockets": len(inodes),
        "tcp_established": counts["tcp_established"],
        "established_from_clients": counts["established_from_clients"],
        "established_to_workers": counts["established_to_workers"],
        "established_other": counts["established_other"],
        **{k: v for k, v in sorted(counts.items()) if k.startswith("tcp_") or k == "non_tcp"},
    }


# --------------------------------------------------------------------------- fleet


@dataclass
class Run:
    """Where the fleet listens and who it is."""

    router: str
    router_pid: int
    router_port: int
    worker_ports: set[int]
    worker_pids: list[int]


def start_workers(
    fleet: Fleet, ports: list[int], max_batch: int, ttft_ms: float, itl_ms: float
) -> None:
    for i, port in enumerate(ports):
        start_simulated_worker(fleet, f"worker{i}", port, MODEL, ttft_ms, itl_ms, max_batch)


def max_batch(clients: int) -> int:
    """Room for every client on one worker, so the simulators never queue."""
    return max(512, clients)


async def start_fleet(fleet: Fleet, args: argparse.Namespace) -> Run:
    clients = args.clients
    ports = free_ports(N_WORKERS + 1)
    router_port, worker_ports = ports[0], ports[1:]
    start_workers(fleet, worker_ports, max_batch(clients), args.ttft_ms, args.itl_ms)
    backlog = max(UVICORN_BACKLOG, clients)
    router_pid = start_router(fleet, router_port, extra_args=["--backlog", str(backlog)])
    router = f"http://{HOST}:{router_port}"
    urls = [f"http://{HOST}:{p}" for p in worker_ports]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in [*urls, router]:
            check = partial(http_ok, session, url + "/health")
            await wait_ready(f"{url}/health", check, fleet)
        await register_workers(session, fleet, router, urls)
    return Run(
        router=router,
        router_pid=router_pid,
        router_port=router_port,
        worker_ports=set(worker_ports),
        worker_pids=[c.pid for c in fleet.procs if c.name != "router"],
    )


async def router_inflight(run: Run) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        workers = await listed_workers(session, run.router)
    return sum(int(w["inflight"]) for w in workers)


async def wait_for_idle_pool(run: Run, idle_wait: float) -> tuple[dict[str, int], float | None]:
    """Poll the router's sockets each second until no TCP connection to a client or a worker is
    left, for at most idle_wait seconds; returns the last reading and when it emptied."""
    t0 = time.monotonic()
    while True:
        sockets = router_sockets(run.router_pid, run.router_port, run.worker_ports)
        elapsed = time.monotonic() - t0
        if sockets["established_to_workers"] + sockets["established_from_clients"] == 0:
            return sockets, elapsed
        if elapsed >= idle_wait:
            return sockets, None
        await asyncio.sleep(1.0)
