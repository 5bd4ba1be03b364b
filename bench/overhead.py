"""What does the router cost? Direct-to-workers against through-the-router, in one run.

Set-up: two sets of four simulated vLLM workers (``manage.py simulate_vllm``), each set serving
one model: ``bench-tiny`` answers at once (ttft 0, itl 0) and ``bench-stream`` behaves like a
small GPU server (ttft 20 ms, itl 5 ms). One router (uvicorn serving ``controlpanel.asgi``) runs
on a throw-away SQLite database with all eight workers registered through the admin API. This
script is the load generator, a separate process from the router and the workers: aiohttp on
uvloop, one ``ClientSession`` with ``TCPConnector(limit=concurrency)`` per round, pre-encoded
bodies, closed loop (``concurrency`` clients, each sending its next request as soon as the
previous answer is read to the end).

Method:

* **Interleaving.** Every scenario runs ``--rounds`` rounds; each round measures both modes back
  to back, alternating which goes first (direct/router, router/direct, ...), so machine drift
  and noisy neighbours hit both modes alike. One unrecorded warm-up round per mode comes first.
* **Direct mode** spreads requests over the four workers round-robin (request i goes to worker
  i mod 4); **router mode** sends everything to the router, which picks by shortest queue.
* **Medians.** Each round yields throughput (successful requests / wall time), latency p50/p99
  and, for streams, TTFT p50 (send to first SSE chunk carrying content). The report shows the
  median over rounds of each figure per mode; "added" figures are router median minus direct
  median, the throughput ratio is router median / direct median.
* **Router CPU from /proc.** utime + stime of the uvicorn process (all its threads) is read from
  ``/proc/<pid>/stat`` before and after every router round; ticks / ``SC_CLK_TCK`` / requests
  gives CPU ms per request (10 ms tick resolution, hence rounds of hundreds of requests). The
  same reading around direct rounds gives the router's background CPU (snapshot refresher,
  in-flight reports), shown separately; it is not subtracted from the target figure. Peak RSS is
  ``VmHWM`` from ``/proc/<pid>/status`` at the end.

Usage: ``.venv/bin/python bench/overhead.py [--rounds N] [--quick]``. Prints a markdown report
and writes the figures, with per-round detail, to ``bench/out/overhead-<timestamp>.json``.
All traffic stays on 127.0.0.1; all subprocesses are stopped on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
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
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
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
CLK_TCK = os.sysconf("SC_CLK_TCK")
JSON_HEADERS = {"Content-Type": "application/json"}
# A delta with at least one character of content; vLLM's first chat chunk has "content":"".
CONTENT_RE = re.compile(rb'"content":"[^"]')
DONE = b"data: [DONE]\n\n"
REQUEST_TIMEOUT_S = 60.0

# Targets from the issue: (label, limit, higher is better).
CPU_TARGET_MS = 0.3
STREAM_RATIO_TARGET = 0.97
TTFT_TARGET_MS = 2.0
RSS_TARGET_MIB = 150.0


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


def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all threads), in seconds."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "; field 3 is fields[0]
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


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

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop them in order
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
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


async def http_ok(session: aiohttp.ClientSession, url: str) -> bool:
    async with session.get(url) as resp:
        await resp.read()
        return resp.status == 200


async def register_workers(
    session: aiohttp.ClientSession, fleet: Fleet, router: str, urls: list[str]
) -> None:
    headers = {"Authorization": f"Bearer {fleet.token}"}
    for url in urls:
        async with session.post(f"{router}/api/workers", json={"url": url}, headers=headers) as r:
            text = await r.text()
            if r.status != 201:
                raise RuntimeError(f"registering {url}: HTTP {r.status} {text[:500]}")

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
        except (aiohttp.ClientError, asyncio.TimeoutError):
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
    client_cpu_ms_per_req: float


def round_stats(
    mode: str, samples: Samples, wall: float, router_cpu: float, client_cpu: float
) -> RoundStats:
    lat = [x * 1000 for x in samples.latencies]
    ttft = [x * 1000 for x in samples.ttfts]
    n = len(lat) + samples.errors
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
        router_cpu_ms=router_cpu * 1000,
        router_cpu_ms_per_req=router_cpu * 1000 / max(n, 1),
        client_cpu_ms_per_req=client_cpu * 1000 / max(n, 1),
    )


def med(rounds: list[RoundStats], attr: str) -> float:
    values = [getattr(r, attr) for r in rounds]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def summarize(sc: Scenario, direct: list[RoundStats], router: list[RoundStats]) -> dict[str, Any]:
    d_rps, r_rps = med(direct, "rps"), med(router, "rps")
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
        "router_idle_cpu_ms_per_s": statistics.median(
            r.router_cpu_ms / r.wall_s for r in direct
        ),
        "client_cpu_ms_per_req_direct": med(direct, "client_cpu_ms_per_req"),
        "client_cpu_ms_per_req_router": med(router, "client_cpu_ms_per_req"),
        "errors": sum(r.errors for r in direct + router),
    }
    summary["added_p50_ms"] = summary["router_p50_ms"] - summary["direct_p50_ms"]
    summary["added_p99_ms"] = summary["router_p99_ms"] - summary["direct_p99_ms"]
    if sc.stream:
        summary["direct_ttft_p50_ms"] = med(direct, "ttft_p50_ms")
        summary["router_ttft_p50_ms"] = med(router, "ttft_p50_ms")
        summary["added_ttft_p50_ms"] = (
            summary["router_ttft_p50_ms"] - summary["direct_ttft_p50_ms"]
        )
    return summary


# --------------------------------------------------------------------------- the benchmark


@dataclass
class Targets:
    direct: dict[str, list[str]]  # model -> worker base URLs
    router: str
    router_pid: int


async def measure(
    targets: Targets, sc: Scenario, mode: str, requests: int
) -> tuple[RoundStats, float]:
    urls = targets.direct[sc.model] if mode == "direct" else [targets.router]
    urls = [u + "/v1/chat/completions" for u in urls]
    cpu0, client0 = cpu_seconds(targets.router_pid), time.process_time()
    samples, wall = await load_round(urls, sc, requests)
    cpu1, client1 = cpu_seconds(targets.router_pid), time.process_time()
    return round_stats(mode, samples, wall, cpu1 - cpu0, client1 - client0), wall


async def run_scenario(
    targets: Targets, sc: Scenario, rounds: int, fleet: Fleet
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    warmup = max(sc.concurrency * 4, 50) if not sc.stream else sc.concurrency * 2
    for mode in ("direct", "router"):
        await measure(targets, sc, mode, min(warmup, sc.requests))
    results: dict[str, list[RoundStats]] = {"direct": [], "router": []}
    for i in range(rounds):
        order = ("direct", "router") if i % 2 == 0 else ("router", "direct")
        for mode in order:
            fleet.check_alive()
            stats, _ = await measure(targets, sc, mode, sc.requests)
            results[mode].append(stats)
            await asyncio.sleep(0.1)
        progress(sc, i, results)
    summary = summarize(sc, results["direct"], results["router"])
    detail = [asdict(r) for r in results["direct"] + results["router"]]
    return summary, detail


def progress(sc: Scenario, i: int, results: dict[str, list[RoundStats]]) -> None:
    d, r = results["direct"][-1], results["router"][-1]
    print(
        f"  {sc.name:<20} round {i + 1}: direct {d.rps:8.1f} req/s p50 {d.p50_ms:6.2f} ms | "
        f"router {r.rps:8.1f} req/s p50 {r.p50_ms:6.2f} ms, "
        f"cpu {r.router_cpu_ms_per_req:.3f} ms/req",
        file=sys.stderr,
        flush=True,
    )


async def start_fleet(fleet: Fleet) -> Targets:
    ports = free_ports(2 * WORKERS_PER_SET + 1)
    router_port, tiny_ports, stream_ports = ports[0], ports[1:5], ports[5:9]
    for i, port in enumerate(tiny_ports):
        start_worker(fleet, f"tiny{i}", port, TINY_MODEL, ttft=0, itl=0)
    for i, port in enumerate(stream_ports):
        start_worker(fleet, f"stream{i}", port, STREAM_MODEL, ttft=20, itl=5)
    router_pid = start_router(fleet, router_port)
    router = f"http://{HOST}:{router_port}"
    direct = {
        TINY_MODEL: [f"http://{HOST}:{p}" for p in tiny_ports],
        STREAM_MODEL: [f"http://{HOST}:{p}" for p in stream_ports],
    }
    all_urls = direct[TINY_MODEL] + direct[STREAM_MODEL]
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for url in [*all_urls, router]:
            await wait_until(f"{url}/health", lambda u=url: http_ok(session, u + "/health"), fleet)
        await register_workers(session, fleet, router, all_urls)
    return Targets(direct=direct, router=router, router_pid=router_pid)


async def benchmark(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    log(f"starting {2 * WORKERS_PER_SET} simulated workers and the router ...")
    targets = await start_fleet(fleet)
    rss_start = status_kib(targets.router_pid, "VmRSS")
    summaries, details = [], {}
    for sc in scenarios(args.quick):
        log(f"scenario {sc.name}: {args.rounds} rounds x {sc.requests} requests per mode")
        summary, detail = await run_scenario(targets, sc, args.rounds, fleet)
        summaries.append(summary)
        details[sc.name] = detail
    pid = targets.router_pid
    memory = {
        "router_rss_start_mib": rss_start / 1024,
        "router_rss_end_mib": status_kib(pid, "VmRSS") / 1024,
        "router_peak_rss_mib": status_kib(pid, "VmHWM") / 1024,
    }
    return {"scenarios": summaries, "memory": memory, "rounds_detail": details}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- report


def fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def figures_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| scenario | direct req/s | router req/s | ratio | direct p50 / p99 ms "
        "| router p50 / p99 ms | added p50 ms | added p99 ms | TTFT p50 direct / router ms "
        "| added TTFT p50 ms | router CPU ms/req | errors |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        ttft = "–"
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


def target_rows(result: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    rows = []
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
    idle = statistics.median(s["router_idle_cpu_ms_per_s"] for s in result["scenarios"])
    lines += [
        "",
        f"Router RSS: {mem['router_rss_start_mib']:.1f} MiB after start-up, "
        f"{mem['router_rss_end_mib']:.1f} MiB at the end, peak {mem['router_peak_rss_mib']:.1f}"
        f" MiB. Router background CPU while idle (during direct rounds): {idle:.1f} ms/s.",
    ]
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
    parser.add_argument("--quick", action="store_true", help="few requests: a ~30 s smoke run")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 5
    if not 1 <= args.rounds <= 100:
        parser.error("--rounds must be between 1 and 100")
    return args


def run_async(coro: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


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
        "config": {"rounds": args.rounds, "quick": args.quick, "python": PYTHON},
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
