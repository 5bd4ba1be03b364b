"""What does the router cost? Direct-to-workers, stack floor and router, in one run.

Set-up: two sets of four simulated vLLM workers (``manage.py simulate_vllm``), each set serving
one model: ``bench-tiny`` answers at once (ttft 0, itl 0) and ``bench-stream`` behaves like a
small GPU server (ttft 20 ms, itl 5 ms). One router (uvicorn serving ``controlpanel.asgi``) runs
on a throw-away SQLite database with all eight workers registered through the admin API. One
floor proxy (``bench/floor_proxy.py``, same uvicorn flags) forwards to the same eight workers,
round-robin per model, and does nothing else: it is the measured lower bound of "uvicorn +
aiohttp client" on this machine, so router CPU minus floor CPU is the router's own cost. This
script is the load generator, a separate process from the router and the workers: aiohttp on
uvloop, one ``ClientSession`` with ``TCPConnector(limit=concurrency)`` per round, pre-encoded
bodies, closed loop (``concurrency`` clients, each sending its next request as soon as the
previous answer is read to the end).

Method:

* **Interleaving.** Every scenario runs ``--rounds`` rounds; each round measures all three modes
  back to back, rotating the order (direct/floor/router, floor/router/direct,
  router/direct/floor, ...), so machine drift and noisy neighbours hit all modes alike. One
  unrecorded warm-up round per mode comes first.
* **Direct mode** spreads requests over the four workers round-robin (request i goes to worker
  i mod 4); **floor mode** sends everything to the floor proxy, which forwards round-robin;
  **router mode** sends everything to the router, which picks by shortest queue.
* **Medians.** Each round yields throughput (successful requests / wall time), latency p50/p99
  and, for streams, TTFT p50 (send to first SSE chunk carrying content). The report shows the
  median over rounds of each figure per mode; "added" figures are router (or floor) median
  minus direct median, the throughput ratio is router median / direct median, and "router
  minus floor CPU" is the router's CPU median minus the floor's.
* **Proxy CPU from /proc.** utime + stime of each uvicorn process (all its threads) is read
  from ``/proc/<pid>/stat`` before and after every round; ticks / ``SC_CLK_TCK`` / requests
  gives CPU ms per request (10 ms tick resolution, hence rounds of hundreds of requests). The
  same reading around the rounds where a proxy serves nothing gives its background CPU (for the
  router: snapshot refresher, in-flight reports), shown separately; it is not subtracted from
  the target figure. Peak RSS is ``VmHWM`` from ``/proc/<pid>/status`` at the end.
* **Quiet machine check.** Busy time from ``/proc/stat`` minus the CPU of the router, the floor
  proxy, the workers and this script is "other load"; above 10 % of the machine the report
  warns that the figures are unreliable.

Usage: ``.venv/bin/python bench/overhead.py [--rounds N] [--quick] [--only SCENARIO]``.
Prints a markdown report and writes the figures, with per-round detail, to
``bench/out/overhead-<timestamp>.json``.
All traffic stays on 127.0.0.1; all subprocesses are stopped on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench" / "out"
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
PYTHON = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
HOST = "127.0.0.1"
WORKERS_PER_SET = 4
TINY_MODEL = "bench-tiny"
STREAM_MODEL = "bench-stream"
STREAM_TOKENS = 64
STREAM_TTFT_MS = 20.0
STREAM_ITL_MS = 5.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
JSON_HEADERS = {"Content-Type": "application/json"}
# A delta with at least one character of content; vLLM's first chat chunk has "content":"".
CONTENT_RE = re.compile(rb'"content":"[^"]')
DONE = b"data: [DONE]\n\n"
REQUEST_TIMEOUT_S = 60.0
REGISTER_ATTEMPTS = 3
PR_SET_PDEATHSIG = 1

# Targets from the issue, printed with PASS/FAIL beside the figures.
CPU_TARGET_MS = 0.3
STREAM_RATIO_TARGET = 0.97
TTFT_TARGET_MS = 2.0
RSS_TARGET_MIB = 150.0
OTHER_LOAD_WARN_PCT = 10.0

# direct: straight to the workers; floor: bench/floor_proxy.py; router: controlpanel.asgi.
MODES = ("direct", "floor", "router")


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    concurrency: int
    requests: int
    stream: bool

    def body(self) -> bytes:
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
            "max_tokens": STREAM_TOKENS if self.stream else 1,
        }
        if self.stream:
            payload["stream"] = True
        return orjson.dumps(payload)


def scenarios(quick: bool) -> list[Scenario]:
    tiny_c1, tiny_cn, streams = (100, 400, 96) if quick else (400, 2000, 320)
    return [
        Scenario("tiny c=1", TINY_MODEL, 1, tiny_c1, stream=False),
        Scenario("tiny c=32", TINY_MODEL, 32, tiny_cn, stream=False),
        Scenario("tiny c=128", TINY_MODEL, 128, tiny_cn, stream=False),
        Scenario(f"stream {STREAM_TOKENS} tok c=32", STREAM_MODEL, 32, streams, stream=True),
    ]


# --------------------------------------------------------------------------- /proc readings


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of a whole process (all its threads), in seconds."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "; field 3 is fields[0]
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks summed over all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]  # user .. steal
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


@dataclass(frozen=True)
class CpuSample:
    """CPU counters read around a round: router and floor (user, sys), workers, machine, this
    process."""

    router_user: float
    router_sys: float
    floor_user: float
    floor_sys: float
    workers: float
    busy: int
    total: int
    client: float

    @classmethod
    def take(cls, router_pid: int, floor_pid: int, worker_pids: list[int]) -> CpuSample:
        user, system = cpu_times(router_pid)
        floor_user, floor_sys = cpu_times(floor_pid)
        workers = sum(sum(cpu_times(pid)) for pid in worker_pids)
        busy, total = machine_ticks()
        return cls(user, system, floor_user, floor_sys, workers, busy, total, time.process_time())

    def ours(self) -> float:
        """CPU seconds of every process this benchmark runs."""
        return (self.router_user + self.router_sys + self.floor_user + self.floor_sys) + (
            self.workers + self.client
        )


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def machine_info() -> dict[str, Any]:
    model = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "kernel": platform.release(),
    }


# --------------------------------------------------------------------------- subprocesses


class Fleet:
    """The subprocesses this script starts, and nothing else; stop() is idempotent."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
        self.token = secrets.token_hex(16)
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.env = self._env()

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPANEL_")}
        for key in ("DATABASE_URL", "REDIS_URL", "DJANGO_DEBUG", "DJANGO_SETTINGS_MODULE"):
            env.pop(key, None)
        env.update(
            DJANGO_SETTINGS_MODULE="controlpanel.settings",
            CONTROLPANEL_VAR_DIR=str(self.tmp),
            DATABASE_URL=f"sqlite:///{self.tmp / 'bench.sqlite3'}",
            CONTROLPANEL_ADMIN_TOKEN=self.token,
            PYTHONUNBUFFERED="1",
        )
        return env

    def spawn(
        self, name: str, args: list[str], extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env={**self.env, **(extra_env or {})},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop them in order
            preexec_fn=_die_with_parent,
        )
        log.close()
        self.procs.append((name, proc))
        return proc

    def run(self, args: list[str]) -> None:
        result = subprocess.run(args, cwd=ROOT, env=self.env, capture_output=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed:\n{result.stderr.decode()[-2000:]}")

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def log_tail(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if this script dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_worker(fleet: Fleet, name: str, port: int, model: str, ttft: float, itl: float) -> None:
    fleet.spawn(
        name,
        [
            PYTHON, "manage.py", "simulate_vllm", "--host", HOST, "--port", str(port),
            "--model", model, "--ttft-ms", str(ttft), "--itl-ms", str(itl),
            "--prefill-ms-per-block", "0", "--max-batch", "512",
        ],
    )  # fmt: skip


def start_router(fleet: Fleet, port: int) -> int:
    fleet.run([PYTHON, "manage.py", "migrate", "--noinput"])
    proc = fleet.spawn(
        "router",
        [
            PYTHON, "-m", "uvicorn", "controlpanel.asgi:application", "--host", HOST,
            "--port", str(port), "--lifespan", "on", "--no-access-log",
        ],
    )  # fmt: skip
    return proc.pid


def start_floor(fleet: Fleet, port: int, upstreams: dict[str, list[str]]) -> int:
    """bench/floor_proxy.py, with exactly the uvicorn flags the router gets."""
    spec = ";".join(f"{model}={','.join(urls)}" for model, urls in upstreams.items())
    proc = fleet.spawn(
        "floor",
        [
            PYTHON, "-m", "uvicorn", "bench.floor_proxy:app", "--host", HOST,
            "--port", str(port), "--lifespan", "on", "--no-access-log",
        ],
        extra_env={"FLOOR_UPSTREAMS": spec},
    )  # fmt: skip
    return proc.pid


async def wait_until(
    what: str, check: Callable[[], Awaitable[bool]], fleet: Fleet, timeout: float = 60.0
) -> None:
    """Poll check() every 0.1 s; bounded by timeout, and fails fast if a child died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fleet.check_alive()
        try:
            if await check():
                return
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


async def http_ok(session: aiohttp.ClientSession, url: str) -> bool:
    async with session.get(url) as resp:
        await resp.read()
        return resp.status == 200


async def post_ok(session: aiohttp.ClientSession, url: str, body: bytes) -> bool:
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        await resp.read()
        return resp.status == 200


async def register_worker(
    session: aiohttp.ClientSession, fleet: Fleet, router: str, url: str
) -> None:
    """POST /api/workers; a 5xx is retried (a 409 on a retry means the first try landed)."""
    headers = {"Authorization": f"Bearer {fleet.token}"}
    for attempt in range(1, REGISTER_ATTEMPTS + 1):
        async with session.post(f"{router}/api/workers", json={"url": url}, headers=headers) as r:
            text = await r.text()
        if r.status == 201 or (r.status == 409 and attempt > 1):
            return
        if r.status < 500 or attempt == REGISTER_ATTEMPTS:
            raise RuntimeError(
                f"registering {url}: HTTP {r.status} {text[:300]}\n"
                f"router log:\n{fleet.log_tail('router')}"
            )
        log(
            f"registering {url}: HTTP {r.status}, retrying; router log:\n{fleet.log_tail('router')}"
        )
        await asyncio.sleep(0.5)


async def register_workers(
    session: aiohttp.ClientSession, fleet: Fleet, router: str, urls: list[str]
) -> None:
    for url in urls:
        await register_worker(session, fleet, router, url)

    async def all_routable() -> bool:
        async with session.get(f"{router}/list_workers") as resp:
            workers = orjson.loads(await resp.read())["workers"]
        return sum(1 for w in workers if w["routable"]) == len(urls)

    await wait_until("all workers routable", all_routable, fleet, timeout=30)


# --------------------------------------------------------------------------- load generator


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)  # seconds
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0


async def one_plain(session: aiohttp.ClientSession, url: str, body: bytes, out: Samples) -> None:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        await resp.read()
        ok = resp.status == 200
    if ok:
        out.latencies.append(time.perf_counter() - t0)
    else:
        out.errors += 1


async def one_stream(session: aiohttp.ClientSession, url: str, body: bytes, out: Samples) -> None:
    t0 = time.perf_counter()
    first = 0.0
    last = b""
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        async for chunk in resp.content.iter_any():
            if not first and CONTENT_RE.search(chunk):
                first = time.perf_counter()
            last = chunk
        ok = resp.status == 200
    if ok and first and last.endswith(DONE):
        out.latencies.append(time.perf_counter() - t0)
        out.ttfts.append(first - t0)
    else:
        out.errors += 1


async def client_loop(
    session: aiohttp.ClientSession, urls: list[str], sc: Scenario, todo: Iterator[int], out: Samples
) -> None:
    """One closed-loop client; all clients share `todo`, so exactly sc.requests are sent."""
    send = one_stream if sc.stream else one_plain
    body = sc.body()
    for i in todo:
        try:
            await send(session, urls[i % len(urls)], body, out)
        except (TimeoutError, aiohttp.ClientError):
            out.errors += 1


async def load_round(urls: list[str], sc: Scenario, requests: int) -> tuple[Samples, float]:
    """Run one round; returns the samples and the wall time in seconds."""
    out = Samples()
    todo = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=sc.concurrency, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        clients = [client_loop(session, urls, sc, todo, out) for _ in range(sc.concurrency)]
        await asyncio.gather(*clients)
        wall = time.perf_counter() - t0
    return out, wall


# --------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of unsorted values."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass
class RoundStats:
    mode: str
    requests: int
    ok: int
    errors: int
    wall_s: float
    rps: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    router_cpu_ms: float
    router_cpu_ms_per_req: float
    router_user_ms_per_req: float
    router_sys_ms_per_req: float
    floor_cpu_ms: float
    floor_cpu_ms_per_req: float
    floor_user_ms_per_req: float
    floor_sys_ms_per_req: float
    client_cpu_ms_per_req: float
    machine_busy_pct: float
    other_busy_pct: float


def round_stats(
    mode: str, samples: Samples, wall: float, before: CpuSample, after: CpuSample
) -> RoundStats:
    lat = [x * 1000 for x in samples.latencies]
    ttft = [x * 1000 for x in samples.ttfts]
    n = len(lat) + samples.errors
    user = after.router_user - before.router_user
    system = after.router_sys - before.router_sys
    floor_user = after.floor_user - before.floor_user
    floor_sys = after.floor_sys - before.floor_sys
    per_req = 1000 / max(n, 1)
    return RoundStats(
        mode=mode,
        requests=n,
        ok=len(lat),
        errors=samples.errors,
        wall_s=wall,
        rps=len(lat) / wall,
        p50_ms=percentile(lat, 50),
        p99_ms=percentile(lat, 99),
        mean_ms=statistics.fmean(lat) if lat else float("nan"),
        max_ms=max(lat, default=float("nan")),
        ttft_p50_ms=percentile(ttft, 50) if ttft else None,
        ttft_p99_ms=percentile(ttft, 99) if ttft else None,
        router_cpu_ms=(user + system) * 1000,
        router_cpu_ms_per_req=(user + system) * per_req,
        router_user_ms_per_req=user * per_req,
        router_sys_ms_per_req=system * per_req,
        floor_cpu_ms=(floor_user + floor_sys) * 1000,
        floor_cpu_ms_per_req=(floor_user + floor_sys) * per_req,
        floor_user_ms_per_req=floor_user * per_req,
        floor_sys_ms_per_req=floor_sys * per_req,
        client_cpu_ms_per_req=(after.client - before.client) * per_req,
        machine_busy_pct=100 * (after.busy - before.busy) / max(after.total - before.total, 1),
        other_busy_pct=other_busy_pct(before, after),
    )


def other_busy_pct(before: CpuSample, after: CpuSample) -> float:
    """Share of all CPUs busy with processes other than this benchmark's (0 on a quiet box)."""
    busy = (after.busy - before.busy) / CLK_TCK
    ours = after.ours() - before.ours()
    return max(0.0, 100 * (busy - ours) * CLK_TCK / max(after.total - before.total, 1))


def med(rounds: list[RoundStats], attr: str) -> float:
    values = [getattr(r, attr) for r in rounds]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def idle_cpu_ms_per_s(rounds: list[RoundStats], proxy: str) -> float:
    """CPU of `proxy` ("router" or "floor") per second of the rounds where it serves nothing
    (for the router: snapshot refresher, in-flight reports)."""
    idle = [r for r in rounds if r.mode != proxy]
    wall = sum(r.wall_s for r in idle)
    cpu = sum(getattr(r, f"{proxy}_cpu_ms") for r in idle)
    return cpu / wall if wall else float("nan")


def summarize(sc: Scenario, results: dict[str, list[RoundStats]]) -> dict[str, Any]:
    direct, floor, router = results["direct"], results["floor"], results["router"]
    d_rps, f_rps, r_rps = med(direct, "rps"), med(floor, "rps"), med(router, "rps")
    every = direct + floor + router
    summary: dict[str, Any] = {
        "scenario": sc.name,
        "concurrency": sc.concurrency,
        "requests_per_round": sc.requests,
        "rounds": len(router),
        "direct_rps": d_rps,
        "router_rps": r_rps,
        "ratio": r_rps / d_rps,
        "direct_p50_ms": med(direct, "p50_ms"),
        "router_p50_ms": med(router, "p50_ms"),
        "direct_p99_ms": med(direct, "p99_ms"),
        "router_p99_ms": med(router, "p99_ms"),
        "router_cpu_ms_per_req": med(router, "router_cpu_ms_per_req"),
        "router_user_ms_per_req": med(router, "router_user_ms_per_req"),
        "router_sys_ms_per_req": med(router, "router_sys_ms_per_req"),
        "floor_rps": f_rps,
        "floor_ratio": f_rps / d_rps,
        "router_floor_ratio": r_rps / f_rps,
        "floor_p50_ms": med(floor, "p50_ms"),
        "floor_p99_ms": med(floor, "p99_ms"),
        "floor_cpu_ms_per_req": med(floor, "floor_cpu_ms_per_req"),
        "floor_user_ms_per_req": med(floor, "floor_user_ms_per_req"),
        "floor_sys_ms_per_req": med(floor, "floor_sys_ms_per_req"),
        "machine_busy_pct_direct": med(direct, "machine_busy_pct"),
        "machine_busy_pct_floor": med(floor, "machine_busy_pct"),
        "machine_busy_pct_router": med(router, "machine_busy_pct"),
        "other_busy_pct": med(every, "other_busy_pct"),
        "router_idle_cpu_ms_per_s": idle_cpu_ms_per_s(every, "router"),
        "floor_idle_cpu_ms_per_s": idle_cpu_ms_per_s(every, "floor"),
        "client_cpu_ms_per_req_direct": med(direct, "client_cpu_ms_per_req"),
        "client_cpu_ms_per_req_floor": med(floor, "client_cpu_ms_per_req"),
        "client_cpu_ms_per_req_router": med(router, "client_cpu_ms_per_req"),
        "errors": sum(r.errors for r in every),
    }
    summary["added_p50_ms"] = summary["router_p50_ms"] - summary["direct_p50_ms"]
    summary["added_p99_ms"] = summary["router_p99_ms"] - summary["direct_p99_ms"]
    summary["floor_added_p50_ms"] = summary["floor_p50_ms"] - summary["direct_p50_ms"]
    summary["floor_added_p99_ms"] = summary["floor_p99_ms"] - summary["direct_p99_ms"]
    summary["router_minus_floor_p50_ms"] = summary["router_p50_ms"] - summary["floor_p50_ms"]
    summary["router_minus_floor_cpu_ms_per_req"] = (
        summary["router_cpu_ms_per_req"] - summary["floor_cpu_ms_per_req"]
    )
    if sc.stream:
        summary["direct_ttft_p50_ms"] = med(direct, "ttft_p50_ms")
        summary["floor_ttft_p50_ms"] = med(floor, "ttft_p50_ms")
        summary["router_ttft_p50_ms"] = med(router, "ttft_p50_ms")
        summary["added_ttft_p50_ms"] = summary["router_ttft_p50_ms"] - summary["direct_ttft_p50_ms"]
        summary["floor_added_ttft_p50_ms"] = (
            summary["floor_ttft_p50_ms"] - summary["direct_ttft_p50_ms"]
        )
        one_stream_s = (STREAM_TTFT_MS + (STREAM_TOKENS - 1) * STREAM_ITL_MS) / 1000
        summary["nominal_rps"] = sc.concurrency / one_stream_s
    return summary


# --------------------------------------------------------------------------- the benchmark


@dataclass
class Targets:
    direct: dict[str, list[str]]  # model -> worker base URLs
    router: str
    router_pid: int
    floor: str
    floor_pid: int
    worker_pids: list[int]

    def sample(self) -> CpuSample:
        return CpuSample.take(self.router_pid, self.floor_pid, self.worker_pids)


async def measure(
    targets: Targets, sc: Scenario, mode: str, requests: int
) -> tuple[RoundStats, float]:
    bases = {"direct": targets.direct[sc.model], "floor": [targets.floor]}
    urls = [u + "/v1/chat/completions" for u in bases.get(mode, [targets.router])]
    before = targets.sample()
    samples, wall = await load_round(urls, sc, requests)
    after = targets.sample()
    return round_stats(mode, samples, wall, before, after), wall


def round_order(i: int) -> tuple[str, ...]:
    """direct/floor/router, floor/router/direct, router/direct/floor, direct/floor/router, ..."""
    k = i % len(MODES)
    return MODES[k:] + MODES[:k]


async def run_scenario(
    targets: Targets, sc: Scenario, rounds: int, fleet: Fleet
) -> tuple[dict[str, Any], list[dict[str, Any]], list[RoundStats]]:
    warmup = max(sc.concurrency * 4, 50) if not sc.stream else sc.concurrency * 2
    for mode in MODES:
        await measure(targets, sc, mode, min(warmup, sc.requests))
    results: dict[str, list[RoundStats]] = {mode: [] for mode in MODES}
    for i in range(rounds):
        for mode in round_order(i):
            fleet.check_alive()
            stats, _ = await measure(targets, sc, mode, sc.requests)
            results[mode].append(stats)
            await asyncio.sleep(0.1)
        progress(sc, i, results)
    summary = summarize(sc, results)
    every = [r for mode in MODES for r in results[mode]]
    return summary, [asdict(r) for r in every], every


def progress(sc: Scenario, i: int, results: dict[str, list[RoundStats]]) -> None:
    d, f, r = (results[mode][-1] for mode in MODES)
    print(
        f"  {sc.name:<20} round {i + 1}: direct {d.rps:7.1f} req/s p50 {d.p50_ms:6.2f} ms | "
        f"floor {f.rps:7.1f} req/s p50 {f.p50_ms:6.2f} ms cpu {f.floor_cpu_ms_per_req:.3f} | "
        f"router {r.rps:7.1f} req/s p50 {r.p50_ms:6.2f} ms cpu {r.router_cpu_ms_per_req:.3f}",
        file=sys.stderr,
        flush=True,
    )


async def start_fleet(fleet: Fleet) -> Targets:
    ports = free_ports(2 * WORKERS_PER_SET + 2)
    router_port, floor_port = ports[0], ports[1]
    tiny_ports = ports[2 : 2 + WORKERS_PER_SET]
    stream_ports = ports[2 + WORKERS_PER_SET :]
    for i, port in enumerate(tiny_ports):
        start_worker(fleet, f"tiny{i}", port, TINY_MODEL, ttft=0, itl=0)
    for i, port in enumerate(stream_ports):
        start_worker(fleet, f"stream{i}", port, STREAM_MODEL, STREAM_TTFT_MS, STREAM_ITL_MS)
    router_pid = start_router(fleet, router_port)
    router = f"http://{HOST}:{router_port}"
    direct = {
        TINY_MODEL: [f"http://{HOST}:{p}" for p in tiny_ports],
        STREAM_MODEL: [f"http://{HOST}:{p}" for p in stream_ports],
    }
    floor_pid = start_floor(fleet, floor_port, direct)
    floor = f"http://{HOST}:{floor_port}"
    all_urls = direct[TINY_MODEL] + direct[STREAM_MODEL]
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for url in [*all_urls, router]:
            await wait_until(f"{url}/health", partial(http_ok, session, url + "/health"), fleet)
        tiny = Scenario("probe", TINY_MODEL, 1, 1, stream=False).body()
        await wait_until(
            f"{floor} (floor proxy)",
            partial(post_ok, session, floor + "/v1/chat/completions", tiny),
            fleet,
        )
        await register_workers(session, fleet, router, all_urls)
    workers = [proc.pid for name, proc in fleet.procs if name not in ("router", "floor")]
    return Targets(
        direct=direct,
        router=router,
        router_pid=router_pid,
        floor=floor,
        floor_pid=floor_pid,
        worker_pids=workers,
    )


def selected(args: argparse.Namespace) -> list[Scenario]:
    return [sc for sc in scenarios(args.quick) if not args.only or sc.name in args.only]


async def benchmark(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    log(f"starting {2 * WORKERS_PER_SET} simulated workers, the router and the floor proxy ...")
    targets = await start_fleet(fleet)
    rss_start = status_kib(targets.router_pid, "VmRSS")
    floor_rss_start = status_kib(targets.floor_pid, "VmRSS")
    summaries, details, every = [], {}, []
    for sc in selected(args):
        log(f"scenario {sc.name}: {args.rounds} rounds x {sc.requests} requests per mode")
        summary, detail, rounds = await run_scenario(targets, sc, args.rounds, fleet)
        summaries.append(summary)
        details[sc.name] = detail
        every += rounds
    pid, floor_pid = targets.router_pid, targets.floor_pid
    memory = {
        "router_rss_start_mib": rss_start / 1024,
        "router_rss_end_mib": status_kib(pid, "VmRSS") / 1024,
        "router_peak_rss_mib": status_kib(pid, "VmHWM") / 1024,
        "floor_rss_start_mib": floor_rss_start / 1024,
        "floor_peak_rss_mib": status_kib(floor_pid, "VmHWM") / 1024,
    }
    return {
        "scenarios": summaries,
        "memory": memory,
        "router_idle_cpu_ms_per_s": idle_cpu_ms_per_s(every, "router"),
        "floor_idle_cpu_ms_per_s": idle_cpu_ms_per_s(every, "floor"),
        "rounds_detail": details,
    }


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- report


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def mark(ok: bool | None) -> str:
    """PASS / FAIL, or "info" for rows that have no limit of their own."""
    return "info" if ok is None else "PASS" if ok else "FAIL"


def figures_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| scenario | direct req/s | router req/s | ratio | direct p50 / p99 ms "
        "| router p50 / p99 ms | added p50 ms | added p99 ms | TTFT p50 direct / router ms "
        "| added TTFT p50 ms | router CPU ms/req | errors |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        ttft = "-"
        if "direct_ttft_p50_ms" in s:
            ttft = f"{fmt(s['direct_ttft_p50_ms'])} / {fmt(s['router_ttft_p50_ms'])}"
        lines.append(
            f"| {s['scenario']} | {s['direct_rps']:.0f} | {s['router_rps']:.0f} "
            f"| {s['ratio']:.3f} | {fmt(s['direct_p50_ms'])} / {fmt(s['direct_p99_ms'])} "
            f"| {fmt(s['router_p50_ms'])} / {fmt(s['router_p99_ms'])} "
            f"| {fmt(s['added_p50_ms'])} | {fmt(s['added_p99_ms'])} | {ttft} "
            f"| {fmt(s.get('added_ttft_p50_ms'))} | {s['router_cpu_ms_per_req']:.3f} "
            f"| {s['errors']} |"
        )
    return lines


def floor_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| scenario | floor req/s | floor / direct | router / floor | floor p50 / p99 ms "
        "| floor added p50 ms | floor added TTFT p50 ms | floor CPU ms/req | router CPU ms/req "
        "| router minus floor CPU ms/req |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['scenario']} | {s['floor_rps']:.0f} | {s['floor_ratio']:.3f} "
            f"| {s['router_floor_ratio']:.3f} "
            f"| {fmt(s['floor_p50_ms'])} / {fmt(s['floor_p99_ms'])} "
            f"| {fmt(s['floor_added_p50_ms'])} | {fmt(s.get('floor_added_ttft_p50_ms'))} "
            f"| {s['floor_cpu_ms_per_req']:.3f} | {s['router_cpu_ms_per_req']:.3f} "
            f"| {s['router_minus_floor_cpu_ms_per_req']:.3f} |"
        )
    return lines


def diagnostics_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| scenario | machine CPU busy % direct / floor / router | other load % "
        "| router user / sys ms/req | floor user / sys ms/req "
        "| client CPU ms/req direct / floor / router |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['scenario']} | {s['machine_busy_pct_direct']:.0f} / "
            f"{s['machine_busy_pct_floor']:.0f} / "
            f"{s['machine_busy_pct_router']:.0f} | {s['other_busy_pct']:.0f} "
            f"| {s['router_user_ms_per_req']:.3f} / {s['router_sys_ms_per_req']:.3f} "
            f"| {s['floor_user_ms_per_req']:.3f} / {s['floor_sys_ms_per_req']:.3f} "
            f"| {s['client_cpu_ms_per_req_direct']:.3f} / "
            f"{s['client_cpu_ms_per_req_floor']:.3f} / "
            f"{s['client_cpu_ms_per_req_router']:.3f} |"
        )
    return lines


def floor_target_row(summaries: list[dict[str, Any]]) -> tuple[str, str, str, None] | None:
    """Informational: is the router's CPU target reachable with this stack at all?"""
    tiny = [s for s in summaries if s["scenario"].startswith("tiny")]
    if not tiny:
        return None
    values = " / ".join(f"{s['floor_cpu_ms_per_req']:.3f}" for s in tiny)
    names = " / ".join(s["scenario"].removeprefix("tiny ") for s in tiny)
    return (
        "stack floor (uvicorn + aiohttp) CPU per tiny request",
        f"{values} ms ({names})",
        f"(router target <= {CPU_TARGET_MS} ms)",
        None,
    )


def target_rows(result: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    rows: list[tuple[str, str, str, bool | None]] = []
    for s in result["scenarios"]:
        if s["scenario"].startswith("tiny"):
            cpu = s["router_cpu_ms_per_req"]
            rows.append(
                (f"router CPU per request, {s['scenario']}", f"{cpu:.3f} ms",
                 f"<= {CPU_TARGET_MS} ms", cpu <= CPU_TARGET_MS)
            )  # fmt: skip
        else:
            ratio, ttft = s["ratio"], s["added_ttft_p50_ms"]
            rows.append(
                (f"throughput ratio, {s['scenario']}", f"{ratio:.3f}",
                 f">= {STREAM_RATIO_TARGET}", ratio >= STREAM_RATIO_TARGET)
            )  # fmt: skip
            rows.append(
                (f"added TTFT p50, {s['scenario']}", f"{ttft:.2f} ms",
                 f"<= {TTFT_TARGET_MS} ms", ttft <= TTFT_TARGET_MS)
            )  # fmt: skip
    floor_row = floor_target_row(result["scenarios"])
    if floor_row is not None:
        rows.append(floor_row)
    rss = result["memory"]["router_peak_rss_mib"]
    rows.append(
        ("router peak RSS (VmHWM)", f"{rss:.1f} MiB", f"<= {RSS_TARGET_MIB:.0f} MiB",
         rss <= RSS_TARGET_MIB)
    )  # fmt: skip
    return rows


def report(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"## Router overhead — {m['date']}",
        "",
        f"Machine: nproc {m['nproc']}, {m['cpu_model']}, Python {m['python']}, "
        f"kernel {m['kernel']}. Rounds: {result['config']['rounds']} per scenario "
        f"(medians shown){', quick mode' if result['config']['quick'] else ''}.",
        "",
        *figures_table(result["scenarios"]),
        "",
        "| target | measured | limit | result |",
        "|---|--:|--:|:-:|",
    ]
    for label, value, limit, ok in target_rows(result):
        lines.append(f"| {label} | {value} | {limit} | {mark(ok)} |")
    mem = result["memory"]
    lines += [
        "",
        "Stack floor (bench/floor_proxy.py: uvicorn with the router's flags, one aiohttp "
        'session, round-robin, nothing else; medians over rounds, "added" = floor minus '
        "direct):",
        "",
        *floor_table(result["scenarios"]),
    ]
    lines += ["", "Diagnostics (medians over rounds):", "", *diagnostics_table(result["scenarios"])]
    lines += [
        "",
        f"Router RSS: {mem['router_rss_start_mib']:.1f} MiB after start-up, "
        f"{mem['router_rss_end_mib']:.1f} MiB at the end, peak {mem['router_peak_rss_mib']:.1f} "
        f"MiB. Floor proxy peak RSS: {mem['floor_peak_rss_mib']:.1f} MiB.",
        f"Background CPU, measured around the rounds where a proxy serves nothing: router "
        f"{result['router_idle_cpu_ms_per_s']:.1f} ms/s, floor "
        f"{result['floor_idle_cpu_ms_per_s']:.1f} ms/s; included in the CPU figures above.",
    ]
    noisy = [
        s["scenario"] for s in result["scenarios"] if s["other_busy_pct"] > OTHER_LOAD_WARN_PCT
    ]
    if noisy:
        lines.append(
            f"WARNING: other processes kept the CPUs more than {OTHER_LOAD_WARN_PCT:.0f} % busy "
            f"during: {', '.join(noisy)}. Those figures are unreliable; rerun on a quiet machine."
        )
    for s in result["scenarios"]:
        if "nominal_rps" in s:
            lines.append(
                f"{s['scenario']}: nominal {s['concurrency']} x ({STREAM_TTFT_MS:g} ms + "
                f"{STREAM_TOKENS - 1} x {STREAM_ITL_MS:g} ms) = {s['nominal_rps']:.1f} req/s; "
                f"direct reached {s['direct_rps']:.1f} (timer overshoot, CPU contention)."
            )
    return "\n".join(lines)


def write_json(result: dict[str, Any]) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = OUT_DIR / f"overhead-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds per scenario (5)")
    parser.add_argument("--quick", action="store_true", help="few requests: a ~40 s smoke run")
    parser.add_argument(
        "--only",
        action="append",
        metavar="SCENARIO",
        choices=[sc.name for sc in scenarios(quick=False)],
        help="run only this scenario (repeatable), e.g. --only 'tiny c=32'",
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 5
    if not 1 <= args.rounds <= 100:
        parser.error("--rounds must be between 1 and 100")
    return args


def run_async(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """uvloop when installed (as uvicorn uses it), so the client costs as little as it can."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fleet = Fleet()
    atexit.register(fleet.stop)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    try:
        result = run_async(benchmark(args, fleet))
    except KeyboardInterrupt:
        log("interrupted; stopping subprocesses")
        return 130
    finally:
        fleet.stop()
    result = {
        "machine": machine_info(),
        "config": {
            "rounds": args.rounds,
            "quick": args.quick,
            "only": args.only,
            "python": PYTHON,
        },
        "duration_s": round(time.monotonic() - started, 1),
        **result,
    }
    print(report(result))
    path = write_json(result)
    log(f"\nwrote {path.relative_to(ROOT)} ({result['duration_s']} s)")
    errors = sum(s["errors"] for s in result["scenarios"])
    if errors:
        log(f"WARNING: {errors} requests failed; the figures are suspect")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
