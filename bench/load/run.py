"""Load: 1,000 concurrent streaming clients through the router for 60 s, with no errors.

Set-up: four simulated vLLM workers (``manage.py simulate_vllm``, one model, ttft 20 ms, itl
5 ms, no per-block prefill cost, ``--max-batch`` at least the number of clients so they never
queue), each its own process. One router (uvicorn serving ``controlpanel.asgi``, the flags
``bench.overhead`` and ``manage.py serve`` use) on a throw-away SQLite database, with the
workers registered through the admin API. This script is the load generator, a separate process:
aiohttp on uvloop, one ``ClientSession`` whose ``TCPConnector`` allows one connection per client.

Method:

* **Closed loop.** ``--clients`` clients start at once, each sending a streamed chat completion
  (``max_tokens`` 64) and the next one as soon as the previous stream has been read to the end,
  until ``--seconds`` have passed; streams under way then finish. Nothing is paced: on a small
  machine the router, the workers and this script share the CPUs, so the streams slow down
  until the machine keeps up (the report shows the nominal rate next to the achieved one).
* **Errors** are any answer other than 200, any stream whose last bytes are not
  ``data: [DONE]``, any stream without a content chunk, and any exception (connect, read
  timeout of 30 s between chunks, disconnect), counted by cause.
* **TTFT** is the time from sending the request to the first SSE chunk whose delta carries
  content (the role-only first chunk does not count), over every completed stream.
* **Router memory**: ``VmRSS`` from ``/proc/<pid>/status`` once the workers are registered
  (start) and after the run (end), and ``VmHWM`` (peak) at the end.
* **Afterwards**, once every client has finished and its session is closed, plus ``--settle``
  seconds: the router's open sockets (``/proc/<pid>/fd`` entries that are sockets, and its TCP
  connections by state, matched by inode in ``/proc/<pid>/net/tcp{,6}``: from clients, to the
  workers, other) and its in-flight counter (sum of ``inflight`` in ``GET /list_workers``, must
  be 0). Connections to the workers stay pooled after the run (aiohttp keep-alive, 30 s in the
  router), so the script then polls every second for up to ``--idle-wait`` seconds until the
  pool is empty, and reports the sockets again: what is left then would be a leak.
* **Machine**: cores, load average before and after, and the CPU each part used during the
  run (router, workers, this script, machine busy share, from ``/proc``), plus the lag of this
  script's event loop (a timer every 100 ms), which inflates client-side TTFT when high.

The open-file limit of this process is raised (soft up to the hard limit) before anything
starts, so the router and the workers inherit it; the router's effective limit is read back
from ``/proc/<pid>/limits``.

Usage: ``.venv/bin/python -m bench.load [--clients N] [--seconds S] [--quick]`` (``--quick``: 100
clients for 10 s); ``--ttft-ms``, ``--itl-ms`` and ``--max-tokens`` change the streams,
``--settle`` and ``--idle-wait`` the waits afterwards.
Prints a markdown report and writes the figures to ``bench/out/load-<timestamp>.json``. Exit
status 1 if any request failed or the in-flight counter does not return to 0.
All traffic stays on 127.0.0.1; all subprocesses are stopped on exit, error or Ctrl-C.

This script is the load generator and the run; the fleet, the open-file limits and the router's
sockets are in ``bench/load/fleet.py``, the report and its checks in ``bench/load/report.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.common.output import log, machine_info, percentile, write_json
from bench.common.wire import CONTENT_RE, DONE, JSON_HEADERS
from bench.load.fleet import (
    MODEL,
    N_WORKERS,
    Run,
    proc_nofile,
    raise_nofile,
    router_inflight,
    router_sockets,
    start_fleet,
    wait_for_idle_pool,
)
from bench.load.report import passed, report
from harness.fleet import PYTHON, ROOT, Fleet, run_with_fleet
from harness.procfs import cpu_times, machine_ticks, status_kib

TTFT_MS = 20.0
ITL_MS = 5.0
MAX_TOKENS = 64
# Generous: under full load a stream takes seconds, but a stalled one must not hang the run.
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=180, sock_connect=30, sock_read=30)
ERROR_PAUSE_S = 0.1  # a client that failed waits this long, so a refusing router is no spin
MONITOR_EVERY_S = 5.0
LAG_EVERY_S = 0.1
FD_MARGIN = 1024


# --------------------------------------------------------------------------- load generator


@dataclass
class Tally:
    completed: int = 0
    ttfts: list[float] = field(default_factory=list)  # seconds
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def request_body(max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello to the load benchmark."}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    )


async def one_stream(session: aiohttp.ClientSession, url: str, body: bytes, tally: Tally) -> None:
    t0 = time.perf_counter()
    first = 0.0
    tail = b""
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        if resp.status != 200:
            await resp.read()
            tally.errors[f"HTTP {resp.status}"] += 1
            return
        async for chunk in resp.content.iter_any():
            if not first and CONTENT_RE.search(chunk):
                first = time.perf_counter()
            tail = (tail + chunk)[-len(DONE) :]
    if tail != DONE:
        tally.errors["stream not ending in data: [DONE]"] += 1
    elif not first:
        tally.errors["stream without a content chunk"] += 1
    else:
        tally.completed += 1
        tally.ttfts.append(first - t0)


async def client(
    session: aiohttp.ClientSession, url: str, body: bytes, deadline: float, tally: Tally
) -> None:
    """One closed-loop client: stream after stream until the deadline."""
    while time.monotonic() < deadline:
        try:
            await one_stream(session, url, body, tally)
        except Exception as exc:  # noqa: BLE001 - every exception is an error to count
            tally.errors[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
            await asyncio.sleep(ERROR_PAUSE_S)


async def loop_lag(lags: list[float], stop: asyncio.Event) -> None:
    """How late a 100 ms timer fires on this script's loop (client-side TTFT inflation)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(LAG_EVERY_S)
        lags.append(loop.time() - t - LAG_EVERY_S)


async def monitor(
    run: Run, tally: Tally, t0: float, stop: asyncio.Event, timeline: list[dict[str, Any]]
) -> None:
    """Every few seconds: progress on stderr, and a timeline point for the JSON."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), MONITOR_EVERY_S)
        point = {
            "t_s": round(time.monotonic() - t0, 1),
            "completed": tally.completed,
            "errors": tally.error_count,
            "router_rss_mib": round(status_kib(run.router_pid, "VmRSS") / 1024, 1),
            "router_cpu_s": round(sum(cpu_times(run.router_pid)), 2),
            "loadavg_1m": os.getloadavg()[0],
        }
        timeline.append(point)
        log(
            f"  t={point['t_s']:5.1f}s completed {point['completed']:7d} errors "
            f"{point['errors']:4d} router RSS {point['router_rss_mib']:6.1f} MiB "
            f"cpu {point['router_cpu_s']:7.2f} s load {point['loadavg_1m']:.2f}"
        )


@dataclass(frozen=True)
class CpuMark:
    router: float
    workers: float
    client: float
    busy: int
    total: int

    @classmethod
    def take(cls, run: Run) -> CpuMark:
        busy, total = machine_ticks()
        return cls(
            router=sum(cpu_times(run.router_pid)),
            workers=sum(sum(cpu_times(pid)) for pid in run.worker_pids),
            client=time.process_time(),
            busy=busy,
            total=total,
        )


def cpu_usage(before: CpuMark, after: CpuMark, wall: float) -> dict[str, float]:
    """Cores used by each part during the run, and the machine's busy share."""
    ticks = max(after.total - before.total, 1)
    ncpu = len(os.sched_getaffinity(0))
    usage = {
        "router_cores": (after.router - before.router) / wall,
        "workers_cores": (after.workers - before.workers) / wall,
        "client_cores": (after.client - before.client) / wall,
        "machine_busy_pct": 100 * (after.busy - before.busy) / ticks,
    }
    ours = usage["router_cores"] + usage["workers_cores"] + usage["client_cores"]
    usage["other_cores"] = max(0.0, usage["machine_busy_pct"] / 100 * ncpu - ours)
    return usage


async def generate_load(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    clients = args.clients
    body = request_body(args.max_tokens)
    tally = Tally()
    lags: list[float] = []
    timeline: list[dict[str, Any]] = []
    stop = asyncio.Event()
    url = run.router + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=clients, limit_per_host=0)
    before = CpuMark.take(run)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=CLIENT_TIMEOUT) as session:
        helpers = [
            asyncio.create_task(loop_lag(lags, stop)),
            asyncio.create_task(monitor(run, tally, t0, stop, timeline)),
        ]
        deadline = t0 + args.seconds
        await asyncio.gather(*(client(session, url, body, deadline, tally) for _ in range(clients)))
        load_wall = time.monotonic() - t0
        after = CpuMark.take(run)
        stop.set()
        await asyncio.gather(*helpers)
    ttft_ms = [x * 1000 for x in tally.ttfts]
    lag_ms = [x * 1000 for x in lags]
    one_stream_s = (args.ttft_ms + (args.max_tokens - 1) * args.itl_ms) / 1000
    return {
        "completed": tally.completed,
        "errors": tally.error_count,
        "errors_by_cause": dict(tally.errors.most_common()),
        "wall_s": load_wall,
        "streams_per_s": tally.completed / load_wall,
        "nominal_streams_per_s": clients / one_stream_s,
        "ttft_p50_ms": percentile(ttft_ms, 50),
        "ttft_p99_ms": percentile(ttft_ms, 99),
        "ttft_max_ms": max(ttft_ms, default=float("nan")),
        "ttft_mean_ms": statistics.fmean(ttft_ms) if ttft_ms else float("nan"),
        "client_loop_lag_p50_ms": percentile(lag_ms, 50),
        "client_loop_lag_p99_ms": percentile(lag_ms, 99),
        "cpu": cpu_usage(before, after, load_wall),
        "timeline": timeline,
    }


# --------------------------------------------------------------------------- the benchmark


async def benchmark(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    log(f"starting {N_WORKERS} simulated workers and the router ...")
    run = await start_fleet(fleet, args)
    router_nofile = proc_nofile(run.router_pid)
    if router_nofile is not None and router_nofile < 2 * args.clients + FD_MARGIN:
        log(f"WARNING: the router may open only {router_nofile} files")
    rss_start = status_kib(run.router_pid, "VmRSS")
    sockets_before = router_sockets(run.router_pid, run.router_port, run.worker_ports)
    loadavg_start = os.getloadavg()
    log(f"{args.clients} clients for {args.seconds:g} s (load average {loadavg_start[0]:.2f}) ...")
    load = await generate_load(run, args)
    loadavg_end = os.getloadavg()
    fleet.check_alive()
    log(f"clients done; settling {args.settle:g} s ...")
    await asyncio.sleep(args.settle)
    after = {
        "rss_mib": status_kib(run.router_pid, "VmRSS") / 1024,
        "hwm_mib": status_kib(run.router_pid, "VmHWM") / 1024,
        "sockets": router_sockets(run.router_pid, run.router_port, run.worker_ports),
        "inflight": await router_inflight(run),
    }
    log(f"after the settle: {after['sockets']}; waiting up to {args.idle_wait:g} s for the pool")
    idle_sockets, emptied_after = await wait_for_idle_pool(run, args.idle_wait)
    rss_idle = status_kib(run.router_pid, "VmRSS") / 1024
    errors_log = fleet.log_tail("router") if load["errors"] else ""
    return {
        "load": load,
        "router": {
            "rss_start_mib": rss_start / 1024,
            "rss_end_mib": after["rss_mib"],
            "hwm_mib": after["hwm_mib"],
            "rss_idle_mib": rss_idle,
            "nofile_limit": router_nofile,
            "sockets_before": sockets_before,
            "sockets_after": after["sockets"],
            "inflight_after": after["inflight"],
            "sockets_after_idle": idle_sockets,
            "pool_emptied_after_s": emptied_after,
            "log_tail": errors_log,
        },
        "loadavg_start": loadavg_start,
        "loadavg_end": loadavg_end,
    }


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument("--clients", type=int, default=None, help="concurrent clients (1000)")
    parser.add_argument("--seconds", type=float, default=None, help="load duration (60)")
    parser.add_argument("--quick", action="store_true", help="100 clients for 10 s")
    parser.add_argument(
        "--settle", type=float, default=2.0, help="seconds after the clients before measuring"
    )
    parser.add_argument(
        "--idle-wait",
        type=float,
        default=70.0,
        help="at most this many seconds for the router's upstream pool to empty (70)",
    )
    parser.add_argument("--ttft-ms", type=float, default=TTFT_MS, help="simulator ttft (20)")
    parser.add_argument("--itl-ms", type=float, default=ITL_MS, help="simulator itl (5)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens per stream (64)")
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or args.ttft_ms < 0 or args.itl_ms < 0:
        parser.error("--max-tokens must be positive, --ttft-ms and --itl-ms not negative")
    if args.clients is None:
        args.clients = 100 if args.quick else 1000
    if args.seconds is None:
        args.seconds = 10.0 if args.quick else 60.0
    if not 1 <= args.clients <= 20_000:
        parser.error("--clients must be between 1 and 20000")
    if args.seconds <= 0 or args.settle < 0 or args.idle_wait < 0:
        parser.error("--seconds must be positive, --settle and --idle-wait not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The router holds a client and an upstream connection per stream; this script one each.
    nofile = raise_nofile(2 * args.clients + FD_MARGIN)
    loadavg_before = os.getloadavg()
    started = time.monotonic()
    measured = run_with_fleet(partial(benchmark, args))
    if measured is None:
        return 130
    result = {
        "machine": {**machine_info(), "somaxconn": _read_int("/proc/sys/net/core/somaxconn")},
        "config": {
            "clients": args.clients,
            "seconds": args.seconds,
            "quick": args.quick,
            "settle": args.settle,
            "idle_wait": args.idle_wait,
            "workers": N_WORKERS,
            "ttft_ms": args.ttft_ms,
            "itl_ms": args.itl_ms,
            "max_tokens": args.max_tokens,
            "nofile": nofile,
            "python": PYTHON,
        },
        "duration_s": round(time.monotonic() - started, 1),
        "loadavg_before": loadavg_before,
        **measured,
    }
    print(report(result))
    path = write_json("load", result)
    log(f"\nwrote {path.relative_to(ROOT)} ({result['duration_s']} s)")
    if result["router"]["log_tail"]:
        log(f"router log tail:\n{result['router']['log_tail']}")
    checks = passed(result)
    return 0 if checks["no errors"] and checks["in-flight back to 0"] else 1


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
