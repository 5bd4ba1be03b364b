"""The router process's memory and imports, and what a malloc setting does to them.

Set-up: four simulated workers per model, as ``bench.overhead`` (``bench-tiny`` answers at once,
``bench-stream`` streams 64 tokens, 20 ms to the first and 5 ms between), and one router per
variant, each uvicorn serving ``controlpanel.asgi`` with ``bench.overhead``'s command line and
environment on a throw-away database of its own. The variants: ``default`` (the environment
as it is) and, for each ``--env NAME=VALUE`` (default ``MALLOC_ARENA_MAX=2``), a router with
that variable set too; all run side by side and get the same traffic, so their figures
compare within one run.

Each router is started through a few lines of ``python -c`` that install a SIGUSR1 handler
writing ``sys.modules`` to a file, then run uvicorn's own ``main()``: the router imports
nothing of the benchmark, and the product has no debug endpoint for it.

Stages, each read from ``/proc/<pid>/status`` (VmRSS, VmHWM) and the router's module list:

* ``started``: ``/health`` answers (the lifespan ran: the refresher's first snapshot);
* ``registered``: the workers added through ``POST /api/workers`` (Django's first requests:
  its URLconf and the admin API), then ``--settle`` seconds of idle (refresher polls);
* ``traffic``: after the /v1 scenarios of ``bench.overhead`` (tiny c=32 and c=128, stream
  c=32, prefix c=32), run on each variant in turn, scenario by scenario; CPU ms per request
  from ``/proc/<pid>/stat`` around each variant's share.

Prints a markdown report (the figures, the top-level packages the default router holds at
each stage and which appeared since the previous one) and writes the figures to
``bench/out/memory-<timestamp>.json``.

Usage: ``.venv/bin/python -m bench.memory [--quick] [--env NAME=VALUE ...] [--settle S]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from bench.common.output import log, machine_info, write_json
from bench.common.router_api import http_ok, register_workers
from bench.overhead.load import (
    STREAM_ITL_MS,
    STREAM_MODEL,
    STREAM_TTFT_MS,
    TINY_MODEL,
    load_round,
    scenarios,
)
from harness.fleet import (
    HOST,
    PYTHON,
    ROOT,
    SERVERS,
    Fleet,
    run_with_fleet,
    start_simulated_worker,
    wait_ready,
)
from harness.processes import free_ports
from harness.procfs import cpu_times, status_kib

WORKERS_PER_MODEL = 4  # as bench.overhead: each registration costs the router memory too
STAGES = ("started", "registered", "traffic")
MODULES_ENV = "BENCH_MEMORY_MODULES"
# The router's entry: dump sys.modules on SIGUSR1, then uvicorn's main() as `python -m uvicorn`.
ENTRY = f"""
import os, signal, sys
def _dump(*_):
    path = os.environ[{MODULES_ENV!r}]
    with open(path + ".tmp", "w") as f:
        f.write("\\n".join(sorted(k for k, v in list(sys.modules.items()) if v is not None)))
    os.replace(path + ".tmp", path)
signal.signal(signal.SIGUSR1, _dump)
sys.argv[0] = "uvicorn"
import uvicorn
uvicorn.main()
"""


@dataclass
class Router:
    name: str
    env: dict[str, str]
    pid: int = 0
    url: str = ""
    modules_path: Path = Path()
    readings: dict[str, dict[str, Any]] = field(default_factory=dict)
    cpu_s: float = 0.0
    requests: int = 0

    def hwm(self) -> str:
        return f"{self.name} VmHWM {status_kib(self.pid, 'VmHWM') / 1024:.1f} MiB"

    def cpu(self) -> float:
        user, system = cpu_times(self.pid)
        return user + system

    async def read(self, stage: str) -> None:
        self.readings[stage] = {
            "rss_mib": round(status_kib(self.pid, "VmRSS") / 1024, 1),
            "hwm_mib": round(status_kib(self.pid, "VmHWM") / 1024, 1),
            "anon_mib": round(status_kib(self.pid, "RssAnon") / 1024, 1),
            "file_mib": round(status_kib(self.pid, "RssFile") / 1024, 1),
            "threads": len(os.listdir(f"/proc/{self.pid}/task")),
            "modules": await self.modules(),
        }

    async def modules(self) -> list[str]:
        self.modules_path.unlink(missing_ok=True)
        os.kill(self.pid, signal.SIGUSR1)
        for _ in range(100):
            if self.modules_path.exists():
                return self.modules_path.read_text().split("\n")
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.name} did not dump its modules")


def start(fleet: Fleet, router: Router) -> None:
    """Migrate its own database, then the router on a free port."""
    env = {**fleet.tree_env(router.name, ROOT, own_db=True), **router.env}
    router.modules_path = fleet.tmp / f"{router.name}.modules"
    env[MODULES_ENV] = str(router.modules_path)
    fleet.run([PYTHON, "manage.py", "migrate", "--noinput"], extra_env=env)
    port = free_ports(1)[0]
    args = [PYTHON, "-c", ENTRY, *SERVERS["uvicorn"][1:], "--host", HOST, "--port", str(port)]
    router.pid = fleet.spawn(router.name, args, extra_env=env).pid
    router.url = f"http://{HOST}:{port}"


def start_workers(fleet: Fleet) -> list[str]:
    urls = []
    for model, ttft, itl in ((TINY_MODEL, 0.0, 0.0), (STREAM_MODEL, STREAM_TTFT_MS, STREAM_ITL_MS)):
        for i, port in enumerate(free_ports(WORKERS_PER_MODEL)):
            start_simulated_worker(fleet, f"{model}-{i}", port, model, ttft=ttft, itl=itl)
            urls.append(f"http://{HOST}:{port}")
    return urls


async def traffic(routers: list[Router], quick: bool) -> None:
    """bench.overhead's scenarios but c=1, each on every router in turn (rotating the order)."""
    for i, sc in enumerate(s for s in scenarios(quick) if s.concurrency > 1):
        order = routers[i % len(routers) :] + routers[: i % len(routers)]
        for router in order:
            before = router.cpu()
            samples, _ = await load_round([router.url + "/v1/chat/completions"], sc, sc.requests)
            router.cpu_s += router.cpu() - before
            router.requests += len(samples.latencies)
            if samples.errors:
                raise RuntimeError(f"{router.name}: {samples.errors} failed requests in {sc.name}")
        log(f"  {sc.name}: " + ", ".join(r.hwm() for r in routers))


async def benchmark(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    urls = start_workers(fleet)
    routers = [Router("default", {})] + [
        Router(f"{name}={value}", {name: value}) for name, value in args.env
    ]
    for router in routers:
        start(fleet, router)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in [*urls, *(r.url for r in routers)]:
            await wait_ready(f"{url}/health", partial(http_ok, session, url + "/health"), fleet)
        for router in routers:
            await router.read("started")
        for router in routers:
            await register_workers(session, fleet, router.url, urls, name=router.name)
    await asyncio.sleep(args.settle)
    for router in routers:
        await router.read("registered")
    await traffic(routers, args.quick)
    fleet.check_alive()
    for router in routers:
        await router.read("traffic")
    return {
        "routers": [
            {
                "name": r.name,
                "env": r.env,
                "stages": r.readings,
                "cpu_ms_per_request": round(1000 * r.cpu_s / max(r.requests, 1), 3),
                "requests": r.requests,
            }
            for r in routers
        ]
    }


def packages(modules: list[str]) -> list[str]:
    """The top-level packages of `modules` that are not the standard library's."""
    tops = {m.split(".")[0] for m in modules if m}
    return sorted(t for t in tops if t not in sys.stdlib_module_names and not t.startswith("_"))


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Router memory (`bench.memory`)",
        "",
        f"{result['machine']['date']}, Python {result['machine']['python']}",
        "",
        "| router | stage | VmRSS MiB | VmHWM MiB | anon MiB | file MiB | threads | modules "
        "| CPU ms/req |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["routers"]:
        for stage in STAGES:
            s = r["stages"][stage]
            cpu = f"{r['cpu_ms_per_request']:.3f}" if stage == "traffic" else ""
            lines.append(
                f"| {r['name']} | {stage} | {s['rss_mib']} | {s['hwm_mib']} | {s['anon_mib']} "
                f"| {s['file_mib']} | {s['threads']} "
                f"| {len(s['modules'])} | {cpu} |"
            )
    default = result["routers"][0]["stages"]
    seen: set[str] = set()
    lines += ["", "Top-level packages (not the standard library's) in the default router:", ""]
    for stage in STAGES:
        now = packages(default[stage]["modules"])
        new = [p for p in now if p not in seen] if seen else now
        lines.append(f"* **{stage}** ({len(now)}), new: {', '.join(new) or 'none'}")
        seen.update(now)
    return "\n".join(lines)


def env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return name, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests per scenario")
    parser.add_argument(
        "--env",
        type=env_pair,
        action="append",
        metavar="NAME=VALUE",
        help="a router variant with this variable set (repeatable; default MALLOC_ARENA_MAX=2;"
        " 'none' for the default router alone)",
    )
    parser.add_argument("--settle", type=float, default=3.0, help="idle seconds after set-up")
    args = parser.parse_args(argv)
    if args.env is None:
        args.env = [("MALLOC_ARENA_MAX", "2")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    measured = run_with_fleet(partial(benchmark, args))
    if measured is None:
        return 130
    result = {
        "machine": machine_info(),
        "config": {"quick": args.quick, "env": args.env, "settle": args.settle},
        "duration_s": round(time.monotonic() - started, 1),
        **measured,
    }
    print(report(result))
    path = write_json("memory", result)
    log(f"\nwrote {path.relative_to(ROOT)} ({result['duration_s']} s)")
    return 0
