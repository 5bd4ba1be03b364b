"""Load: 1,000 concurrent streaming clients through the router for 60 s, with no errors.

Set-up: four simulated vLLM workers (``manage.py simulate_vllm``, one model, ttft 20 ms, itl
5 ms, no per-block prefill cost, ``--max-batch`` at least the number of clients so they never
queue), each its own process. One router (uvicorn serving ``controlpanel.asgi``, the flags
``bench/overhead.py`` and ``manage.py serve`` use) on a throw-away SQLite database, with the
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

Usage: ``.venv/bin/python bench/load.py [--clients N] [--seconds S] [--quick]`` (``--quick``: 100
clients for 10 s); ``--ttft-ms``, ``--itl-ms`` and ``--max-tokens`` change the streams,
``--settle`` and ``--idle-wait`` the waits afterwards.
Prints a markdown report and writes the figures to ``bench/out/load-<timestamp>.json``. Exit
status 1 if any request failed or the in-flight counter does not return to 0.
All traffic stays on 127.0.0.1; all subprocesses are stopped on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import resource
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

try:  # run as `python -m bench.load` from the repository root
    from bench import overhead as oh
except ImportError:  # run as `python bench/load.py` (bench/ is on sys.path)
    import overhead as oh  # type: ignore[no-redef,import-not-found]

HOST = oh.HOST
ROOT = oh.ROOT
OUT_DIR = oh.OUT_DIR
PYTHON = oh.PYTHON
CLK_TCK = oh.CLK_TCK
DONE = oh.DONE
CONTENT_RE = oh.CONTENT_RE
log = oh.log

MODEL = "bench-load"
N_WORKERS = 4
TTFT_MS = 20.0
ITL_MS = 5.0
MAX_TOKENS = 64
# Generous: under full load a stream takes seconds, but a stalled one must not hang the run.
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=180, sock_connect=30, sock_read=30)
ERROR_PAUSE_S = 0.1  # a client that failed waits this long, so a refusing router is no spin
MONITOR_EVERY_S = 5.0
LAG_EVERY_S = 0.1
UVICORN_BACKLOG = 2048  # uvicorn's default; raised to --clients when that is larger
FD_MARGIN = 1024
TCP_STATES = {
    "01": "established",
    "02": "syn_sent",
    "03": "syn_recv",
    "04": "fin_wait1",
    "05": "fin_wait2",
    "06": "time_wait",
    "07": "close",
    "08": "close_wait",
    "09": "last_ack",
    "0A": "listen",
    "0B": "closing",
}


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


def tcp_table(pid: int) -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) for every TCP socket in pid's namespace."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            local, remote, state, inode = cols[1], cols[2], cols[3], int(cols[9])
            port = int(local.rsplit(":", 1)[1], 16)
            remote_port = int(remote.rsplit(":", 1)[1], 16)
            table[inode] = (port, remote_port, TCP_STATES.get(state, state))
    return table


def socket_inodes(pid: int) -> tuple[int, list[int]]:
    """(open fds, inodes of the fds that are sockets) of a process."""
    fd_dir = Path(f"/proc/{pid}/fd")
    fds = os.listdir(fd_dir)
    inodes = []
    for fd in fds:
        with contextlib.suppress(FileNotFoundError):  # closed while we looked
            target = os.readlink(fd_dir / fd)
            if target.startswith("socket:["):
                inodes.append(int(target[8:-1]))
    return len(fds), inodes


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
    async with session.post(url, data=body, headers=oh.JSON_HEADERS) as resp:
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


@dataclass
class Run:
    """Where the fleet listens and who it is."""

    router: str
    router_pid: int
    router_port: int
    worker_ports: set[int]
    worker_pids: list[int]


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
            "router_rss_mib": round(oh.status_kib(run.router_pid, "VmRSS") / 1024, 1),
            "router_cpu_s": round(sum(oh.cpu_times(run.router_pid)), 2),
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
        busy, total = oh.machine_ticks()
        return cls(
            router=sum(oh.cpu_times(run.router_pid)),
            workers=sum(sum(oh.cpu_times(pid)) for pid in run.worker_pids),
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
        "ttft_p50_ms": oh.percentile(ttft_ms, 50),
        "ttft_p99_ms": oh.percentile(ttft_ms, 99),
        "ttft_max_ms": max(ttft_ms, default=float("nan")),
        "ttft_mean_ms": statistics.fmean(ttft_ms) if ttft_ms else float("nan"),
        "client_loop_lag_p50_ms": oh.percentile(lag_ms, 50),
        "client_loop_lag_p99_ms": oh.percentile(lag_ms, 99),
        "cpu": cpu_usage(before, after, load_wall),
        "timeline": timeline,
    }


# --------------------------------------------------------------------------- fleet


def start_workers(
    fleet: oh.Fleet, ports: list[int], max_batch: int, ttft_ms: float, itl_ms: float
) -> None:
    for i, port in enumerate(ports):
        fleet.spawn(
            f"worker{i}",
            [
                PYTHON, "manage.py", "simulate_vllm", "--host", HOST, "--port", str(port),
                "--model", MODEL, "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms),
                "--prefill-ms-per-block", "0", "--max-batch", str(max_batch),
            ],
        )  # fmt: skip


def max_batch(clients: int) -> int:
    """Room for every client on one worker, so the simulators never queue."""
    return max(512, clients)


def start_router(fleet: oh.Fleet, port: int, backlog: int) -> int:
    """The router with bench/overhead.py's flags (uvicorn's default backlog unless raised)."""
    fleet.run([PYTHON, "manage.py", "migrate", "--noinput"])
    proc = fleet.spawn(
        "router",
        [
            PYTHON, "-m", "uvicorn", "controlpanel.asgi:application", "--host", HOST,
            "--port", str(port), "--lifespan", "on", "--no-access-log",
            "--backlog", str(backlog),
        ],
    )  # fmt: skip
    return proc.pid


async def start_fleet(fleet: oh.Fleet, args: argparse.Namespace) -> Run:
    clients = args.clients
    ports = oh.free_ports(N_WORKERS + 1)
    router_port, worker_ports = ports[0], ports[1:]
    start_workers(fleet, worker_ports, max_batch(clients), args.ttft_ms, args.itl_ms)
    router_pid = start_router(fleet, router_port, backlog=max(UVICORN_BACKLOG, clients))
    router = f"http://{HOST}:{router_port}"
    urls = [f"http://{HOST}:{p}" for p in worker_ports]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in [*urls, router]:
            check = partial(oh.http_ok, session, url + "/health")
            await oh.wait_until(f"{url}/health", check, fleet)
        await oh.register_workers(session, fleet, router, urls)
    return Run(
        router=router,
        router_pid=router_pid,
        router_port=router_port,
        worker_ports=set(worker_ports),
        worker_pids=[p.pid for name, p in fleet.procs if name != "router"],
    )


async def router_inflight(run: Run) -> int:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(run.router + "/list_workers") as resp,
    ):
        workers = orjson.loads(await resp.read())["workers"]
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


async def benchmark(args: argparse.Namespace, fleet: oh.Fleet) -> dict[str, Any]:
    log(f"starting {N_WORKERS} simulated workers and the router ...")
    run = await start_fleet(fleet, args)
    router_nofile = proc_nofile(run.router_pid)
    if router_nofile is not None and router_nofile < 2 * args.clients + FD_MARGIN:
        log(f"WARNING: the router may open only {router_nofile} files")
    rss_start = oh.status_kib(run.router_pid, "VmRSS")
    sockets_before = router_sockets(run.router_pid, run.router_port, run.worker_ports)
    loadavg_start = os.getloadavg()
    log(f"{args.clients} clients for {args.seconds:g} s (load average {loadavg_start[0]:.2f}) ...")
    load = await generate_load(run, args)
    loadavg_end = os.getloadavg()
    fleet.check_alive()
    log(f"clients done; settling {args.settle:g} s ...")
    await asyncio.sleep(args.settle)
    after = {
        "rss_mib": oh.status_kib(run.router_pid, "VmRSS") / 1024,
        "hwm_mib": oh.status_kib(run.router_pid, "VmHWM") / 1024,
        "sockets": router_sockets(run.router_pid, run.router_port, run.worker_ports),
        "inflight": await router_inflight(run),
    }
    log(f"after the settle: {after['sockets']}; waiting up to {args.idle_wait:g} s for the pool")
    idle_sockets, emptied_after = await wait_for_idle_pool(run, args.idle_wait)
    rss_idle = oh.status_kib(run.router_pid, "VmRSS") / 1024
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


# --------------------------------------------------------------------------- report


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def sockets_line(label: str, s: dict[str, int]) -> str:
    other = {k: v for k, v in s.items() if k.startswith("tcp_") and k != "tcp_established"}
    extra = ", ".join(f"{k.removeprefix('tcp_')} {v}" for k, v in other.items())
    return (
        f"| {label} | {s['fds']} | {s['sockets']} | {s['tcp_established']} "
        f"| {s['established_from_clients']} | {s['established_to_workers']} "
        f"| {s['established_other']} | {s.get('non_tcp', 0)} | {extra or '-'} |"
    )


def passed(result: dict[str, Any]) -> dict[str, bool]:
    r = result["router"]
    return {
        "no errors": result["load"]["errors"] == 0,
        "in-flight back to 0": r["inflight_after"] == 0,
        "no client connection left": r["sockets_after"]["established_from_clients"] == 0,
        "upstream pool empties when idle": r["pool_emptied_after_s"] is not None,
    }


def report(result: dict[str, Any]) -> str:
    m, cfg, load, r = result["machine"], result["config"], result["load"], result["router"]
    cpu = load["cpu"]
    la0, la1 = result["loadavg_before"], result["loadavg_end"]
    lines = [
        f"## Load — {m['date']}",
        "",
        f"Machine: {m['nproc']} cores, {m['cpu_model']}, Python {m['python']}, aiohttp "
        f"{m['aiohttp']}, kernel {m['kernel']}. Load average before "
        f"{la0[0]:.2f} / {la0[1]:.2f} / {la0[2]:.2f}, after the run "
        f"{la1[0]:.2f} / {la1[1]:.2f} / {la1[2]:.2f}.",
        f"{cfg['clients']} streaming clients for {cfg['seconds']:g} s through the router to "
        f"{N_WORKERS} simulated workers (ttft {cfg['ttft_ms']:g} ms, itl {cfg['itl_ms']:g} ms, "
        f"{cfg['max_tokens']} tokens, max batch {max_batch(cfg['clients'])}); open-file limit "
        f"{cfg['nofile']['soft']} (router {r['nofile_limit']}).",
        "",
        "| figure | value |",
        "|---|--:|",
        f"| streams completed | {load['completed']} |",
        f"| errors | {load['errors']} |",
        f"| streams/s (nominal without CPU limits) | {load['streams_per_s']:.0f} "
        f"({load['nominal_streams_per_s']:.0f}) |",
        f"| TTFT p50 / p99 / max ms | {fmt(load['ttft_p50_ms'])} / {fmt(load['ttft_p99_ms'])} "
        f"/ {fmt(load['ttft_max_ms'])} |",
        f"| router RSS start / end / peak (VmHWM) MiB | {r['rss_start_mib']:.1f} / "
        f"{r['rss_end_mib']:.1f} / {r['hwm_mib']:.1f} |",
        f"| router RSS once the upstream pool is idle MiB | {r['rss_idle_mib']:.1f} |",
        f"| router in-flight afterwards | {r['inflight_after']} |",
        f"| CPU cores used: router / workers / load generator | {cpu['router_cores']:.2f} / "
        f"{cpu['workers_cores']:.2f} / {cpu['client_cores']:.2f} |",
        f"| machine busy % (cores used by other processes) | {cpu['machine_busy_pct']:.0f} "
        f"({cpu['other_cores']:.2f}) |",
        f"| load generator loop lag p50 / p99 ms | {fmt(load['client_loop_lag_p50_ms'])} / "
        f"{fmt(load['client_loop_lag_p99_ms'])} |",
        "",
        "Router sockets (`/proc/<pid>/fd`, TCP by inode in `/proc/<pid>/net/tcp{,6}`):",
        "",
        "| when | fds | sockets | TCP established | from clients | to workers | other "
        "| non-TCP | other TCP states |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|",
        sockets_line("before the run", r["sockets_before"]),
        sockets_line(f"{cfg['settle']:g} s after the clients finished", r["sockets_after"]),
    ]
    emptied = r["pool_emptied_after_s"]
    idle_label = (
        f"{emptied:.0f} s later, pool empty"
        if emptied is not None
        else f"{cfg['idle_wait']:g} s later, pool NOT empty"
    )
    lines += [sockets_line(idle_label, r["sockets_after_idle"]), ""]
    lines += ["| check | result |", "|---|:-:|"]
    lines += [f"| {name} | {'PASS' if ok else 'FAIL'} |" for name, ok in passed(result).items()]
    if load["errors_by_cause"]:
        lines += ["", "Errors by cause:", ""]
        lines += [f"* {n} x {cause}" for cause, n in load["errors_by_cause"].items()]
    return "\n".join(lines)


def write_json(result: dict[str, Any]) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = OUT_DIR / f"load-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
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
    fleet = oh.Fleet()
    atexit.register(fleet.stop)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    try:
        result = oh.run_async(benchmark(args, fleet))
    except KeyboardInterrupt:
        log("interrupted; stopping subprocesses")
        return 130
    finally:
        fleet.stop()
    result = {
        "machine": {**oh.machine_info(), "somaxconn": _read_int("/proc/sys/net/core/somaxconn")},
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
        **result,
    }
    print(report(result))
    path = write_json(result)
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


if __name__ == "__main__":
    sys.exit(main())
