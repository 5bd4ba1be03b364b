"""What the serve tree costs with no traffic (issue 29): started as a user starts it, left
alone, measured.

    .venv/bin/python -m bench.idle [--workers 4] [--settle 30] [--measure 60]
    .venv/bin/python -m bench.idle --redis-url redis://127.0.0.1:6379/9 --routers 2
    .venv/bin/python -m bench.idle --quick        # 5 s settle, 15 s measured

* **What runs:** ``--workers`` simulated vLLM workers (``manage.py simulate_vllm``, outside
  the serve tree), then ``manage.py serve --port P --routers R`` on the fleet's throw-away
  SQLite database and var dir (harness.fleet), which becomes the launcher: router
  process(es), a Celery worker with beat. The workers are registered through
  ``POST /api/workers`` and the run waits until the router lists them all as routable.
  ``--redis-url`` sets ``REDIS_URL`` for serve (several routers need it); the probe interval
  is set explicitly (``--probe-interval``, the default 5 s) so the report can say at what
  rate the control plane probes.
* **Measured:** after ``--settle`` seconds, every process of the serve tree (serve's pid and
  all its descendants, read from ``/proc``) and every worker's, utime + stime over
  ``--measure`` seconds, as % of one core per process, per thread, and in total; the
  router's RSS now and at its peak (VmRSS, VmHWM).
* **Target:** the serve tree's total ≤ 1 % of one core. Probing N workers at the configured
  interval is work the operator asked for; the report names the rate beside the figure.

Output: markdown on stdout, progress on stderr, ``bench/out/idle-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from bench.common.output import OUT_DIR, log, machine_info, write_json
from bench.common.router_api import http_ok, register_workers
from bench.idle import tree
from bench.idle.report import report
from harness.fleet import HOST, PYTHON, Fleet, run_with_fleet, start_simulated_worker, wait_ready
from harness.processes import free_ports

MODEL = "idle-model"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=(__doc__ or "").split("\n", 1)[0]
    )
    parser.add_argument("--workers", type=int, default=4, help="simulated workers registered")
    parser.add_argument("--routers", type=int, default=1, help="serve --routers N")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds before measuring")
    parser.add_argument("--measure", type=float, default=60.0, help="seconds measured")
    parser.add_argument("--probe-interval", type=float, default=5.0,
                        help="CONTROLPANEL_PROBE_INTERVAL for serve (seconds)")  # fmt: skip
    parser.add_argument("--redis-url", default=None, help="REDIS_URL for serve (optional)")
    parser.add_argument("--quick", action="store_true", help="5 s settle, 15 s measured")
    args = parser.parse_args(argv)
    if args.quick:
        args.settle, args.measure = 5.0, 15.0
    return args


def health(session: aiohttp.ClientSession, url: str) -> Callable[[], Awaitable[bool]]:
    return lambda: http_ok(session, f"{url}/health")


async def start(fleet: Fleet, args: argparse.Namespace) -> tuple[int, str, list[str]]:
    """The workers, then serve; returns serve's pid, its base URL and the workers' URLs."""
    ports = free_ports(args.workers + 1)
    port, worker_ports = ports[0], ports[1:]
    for i, wport in enumerate(worker_ports):
        start_simulated_worker(fleet, f"worker-{i + 1}", wport, MODEL, ttft=20, itl=10)
    env = {"CONTROLPANEL_PROBE_INTERVAL": str(args.probe_interval)}
    if args.redis_url:
        env["REDIS_URL"] = args.redis_url
    serve = fleet.spawn(
        "serve",
        [PYTHON, "manage.py", "serve", "--host", HOST, "--port", str(port),
         "--routers", str(args.routers)],
        extra_env=env,
    )  # fmt: skip
    base = f"http://{HOST}:{port}"
    urls = [f"http://{HOST}:{p}" for p in worker_ports]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        for url in urls:
            await wait_ready(url, health(session, url), fleet)
        await wait_ready("serve", health(session, base), fleet, 120)
        await register_workers(session, fleet, base, urls, name="serve")
    return serve.pid, base, urls


async def benchmark(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    serve_pid, _, urls = await start(fleet, args)
    log(f"serve (pid {serve_pid}) routes to {len(urls)} workers; settling {args.settle:.0f} s")
    await asyncio.sleep(args.settle)
    fleet.check_alive()
    workers = [fleet.child(f"worker-{i + 1}").pid for i in range(args.workers)]
    serve_tree = tree.descendants(serve_pid)
    log(f"measuring {len(serve_tree)} serve processes and {len(workers)} workers "
        f"for {args.measure:.0f} s")  # fmt: skip
    pids = serve_tree + [p for w in workers for p in tree.descendants(w)]
    before, started = tree.sample(pids), time.monotonic()
    await asyncio.sleep(args.measure)
    fleet.check_alive()
    seconds = time.monotonic() - started
    after = tree.sample(tree.descendants(serve_pid) + [
        p for w in workers for p in tree.descendants(w)])  # fmt: skip
    rows = tree.window(before, after, seconds)
    worker_pids = {p for w in workers for p in tree.descendants(w)}
    return {
        "machine": machine_info(),
        "config": {k: v for k, v in vars(args).items() if k != "quick"},
        "seconds": round(seconds, 2),
        "serve": [r for r in rows if r["pid"] not in worker_pids],
        "workers": [r for r in rows if r["pid"] in worker_pids],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_with_fleet(lambda fleet: benchmark(fleet, args))
    if result is None:
        return 130
    path = write_json("idle", result)
    print(report(result))
    log(f"figures: {path.relative_to(OUT_DIR.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
