"""Profile the router on the overhead benchmark's workloads: where each microsecond goes.

Set-up: ``bench.overhead``'s fleet in small (four simulated workers answering at once for the
tiny and prefix workloads, four with a small GPU's timing for streams; the router is uvicorn
serving ``controlpanel.asgi`` on a throw-away database, every worker registered through the
admin API). For each workload a closed loop (``bench.overhead.load``) keeps the router busy
while ``py-spy record`` samples the router process (its own thread only: ``--gil`` off,
idle frames dropped), then the sampled stacks are written as a flame graph
(``bench/profile/out/<workload>.svg``) and folded into two tables: the functions by their own
samples (self time) and by the samples they appear in (inclusive), each in µs per request
(the share of samples times the router's measured CPU per request from ``/proc``).

Workloads: ``tiny`` (a one-token chat answer, c=32), ``stream`` (64 streamed tokens, c=32) and
``prefix`` (a 4,000-word prompt of which most is shared between requests, one token back,
c=32; the router's policy stays shortest_queue, so this is the cost of reading a long body).

Targets (``--target``, repeatable; the router by default): ``router`` and ``floor``, the
floor proxy (``bench/common/floor_proxy.py``, the same uvicorn flags, the same workers), so
the router's own time can be told from the stack's package by package in one run; the
floor's files are ``floor-<workload>.*``.

Usage: ``.venv/bin/python -m bench.profile [--seconds 20] [--only tiny] [--target floor]``;
needs ``py-spy`` (the project's dev extras). Prints the tables in markdown, writes the flame
graphs and ``bench/out/profile-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from bench.common.floor import start_floor
from bench.common.output import log, machine_info, write_json
from bench.common.router_api import http_ok, register_workers
from bench.overhead.load import (
    STREAM_ITL_MS,
    STREAM_MODEL,
    STREAM_TTFT_MS,
    TINY_MODEL,
    Scenario,
    load_round,
)
from bench.profile.folded import Table, fold, markdown, package_us, packages_markdown
from harness.fleet import (
    HOST,
    ROOT,
    Fleet,
    run_with_fleet,
    start_router,
    start_simulated_worker,
    wait_ready,
)
from harness.processes import free_ports
from harness.procfs import cpu_times

OUT = Path(__file__).resolve().parent / "out"
PREFIX_WORDS = 4000
RATE_HZ = 250


class PrefixScenario(Scenario):
    """A long prompt, mostly shared: the body the router reads and parses is 20-30 KB."""

    def body(self) -> bytes:
        shared = " ".join(f"w{i % 97}" for i in range(PREFIX_WORDS - 40))
        return (
            super()
            .body()
            .replace(b"Say hello to the benchmark.", f"{shared} and then some.".encode())
        )


WORKLOADS: dict[str, Scenario] = {
    "tiny": Scenario("tiny", TINY_MODEL, 32, 0, stream=False),
    "stream": Scenario("stream", STREAM_MODEL, 32, 0, stream=True),
    "prefix": PrefixScenario("prefix", TINY_MODEL, 32, 0, stream=False),
}


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is missing: `make install` brings it (the dev extras)")
    return found


TARGETS = ("router", "floor")


async def start(fleet: Fleet) -> dict[str, tuple[str, int]]:
    """The workers, the router and the floor proxy; {target: (base URL, pid)}."""
    ports = free_ports(10)
    for i, port in enumerate(ports[1:5]):
        start_simulated_worker(fleet, f"tiny{i}", port, TINY_MODEL, ttft=0, itl=0)
    for i, port in enumerate(ports[5:9]):
        start_simulated_worker(
            fleet, f"stream{i}", port, STREAM_MODEL, STREAM_TTFT_MS, STREAM_ITL_MS
        )
    urls = [f"http://{HOST}:{p}" for p in ports[1:9]]
    # Before the router, whose start-up takes a while: its port must not go to another.
    floor_pid = start_floor(
        fleet, ports[9], {TINY_MODEL: urls[:4], STREAM_MODEL: urls[4:]}, name="floor"
    )
    pid = start_router(fleet, ports[0])
    router = f"http://{HOST}:{ports[0]}"
    floor = f"http://{HOST}:{ports[9]}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in [*urls, router]:
            await wait_ready(f"{url}/health", partial(http_ok, session, url + "/health"), fleet)
        await register_workers(session, fleet, router, urls)
        # The floor has no /health: it is ready once it forwards a request.
        await wait_ready("the floor proxy", partial(floor_ok, session, floor), fleet)
    return {"router": (router, pid), "floor": (floor, floor_pid)}


async def floor_ok(session: aiohttp.ClientSession, floor: str) -> bool:
    body = WORKLOADS["tiny"].body()
    async with session.post(floor + "/v1/chat/completions", data=body) as answer:
        await answer.read()
        return answer.status == 200


async def keep_busy(router: str, sc: Scenario, until: float) -> int:
    """Closed-loop rounds until `until`; the requests answered."""
    answered = 0
    url = [router + "/v1/chat/completions"]
    while time.monotonic() < until:
        samples, _ = await load_round(url, sc, 400 if not sc.stream else 96)
        answered += len(samples.latencies)
    return answered


async def profile(router: str, pid: int, name: str, sc: Scenario, seconds: float) -> dict[str, Any]:
    await keep_busy(router, sc, time.monotonic() + 3)  # warm
    raw, svg = OUT / f"{name}.folded", OUT / f"{name}.svg"
    # Two samplers side by side (non-blocking: neither stops the router), one for the
    # tables and one for the flame graph, since py-spy writes one format per run.
    spies = [
        await asyncio.create_subprocess_exec(
            py_spy(),
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(RATE_HZ),
            "--duration",
            str(int(seconds)),
            "--format",
            fmt,
            "--output",
            str(path),
            "--nonblocking",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for fmt, path in (("raw", raw), ("flamegraph", svg))
    ]
    cpu0 = sum(cpu_times(pid))
    answered = await keep_busy(router, sc, time.monotonic() + seconds)
    cpu = sum(cpu_times(pid)) - cpu0
    if any([await spy.wait() for spy in spies]):
        raise RuntimeError(f"py-spy failed on {name}")
    us_per_request = cpu / answered * 1e6 if answered else 0.0
    table = fold(raw.read_text(), us_per_request)
    return {
        "requests": answered,
        "cpu_us_per_request": us_per_request,
        "packages": package_us(table),
        "table": table.record(),
    }


async def benchmark(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    OUT.mkdir(exist_ok=True)
    log("starting 8 simulated workers, the router and the floor proxy ...")
    targets = await start(fleet)
    results = {}
    for name in args.only or list(WORKLOADS):
        for target in args.target or ["router"]:
            url, pid = targets[target]
            label = name if target == "router" else f"{target}-{name}"
            log(f"profiling {label} for {args.seconds:.0f} s ...")
            results[label] = await profile(url, pid, label, WORKLOADS[name], args.seconds)
    return {"workloads": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--only", action="append", choices=list(WORKLOADS))
    parser.add_argument("--target", action="append", choices=TARGETS)
    args = parser.parse_args(argv)
    measured = run_with_fleet(partial(benchmark, args))
    if measured is None:
        return 130
    result = {"machine": machine_info(), "rate_hz": RATE_HZ, **measured}
    for name, figures in result["workloads"].items():
        table = Table.from_record(figures["table"])
        print(markdown(name, figures["cpu_us_per_request"], table))
        print(packages_markdown(name, figures["packages"]))
    path = write_json("profile", result)
    log(f"wrote {path.relative_to(ROOT)} and the flame graphs in {OUT.relative_to(ROOT)}")
    return 0
