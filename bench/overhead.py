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
* **Baseline** (``--baseline-tree DIR``). A fourth mode: a second router started from the
  checkout in DIR (say, the code before a change) with the same uvicorn command, flags and
  environment, cwd and PYTHONPATH set to DIR, its own throw-away database and var dir, and the
  same eight workers (started from this checkout) added through its ``POST /api/workers``. It
  joins the interleaved rotation (direct/floor/router/baseline, floor/router/baseline/direct,
  ...), and the report puts it next to the router: CPU per request, router minus floor and
  baseline minus floor, throughput, added latency and TTFT, all from the same run.
* **Quiet machine check.** Busy time from ``/proc/stat`` minus the CPU of the router, the floor
  proxy, the workers and this script is "other load"; above 10 % of the machine the report
  warns that the figures are unreliable.

Usage: ``.venv/bin/python bench/overhead.py [--rounds N] [--quick] [--only SCENARIO]
[--baseline-tree DIR]``.
Prints a markdown report and writes the figures, with per-round detail, to
``bench/out/overhead-<timestamp>.json``.
All traffic stays on 127.0.0.1; all subprocesses are stopped on exit, error or Ctrl-C.

This script starts the fleet and runs the rounds; the scenarios, modes and load generator are
in ``bench/overhead_load.py``, the per-round figures and medians in ``bench/overhead_stats.py``,
the report in ``bench/overhead_report.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for `python bench/overhead.py`
from bench.harness import (
    HOST,
    PYTHON,
    ROOT,
    Fleet,
    free_ports,
    http_ok,
    log,
    machine_info,
    post_ok,
    register_workers,
    run_with_fleet,
    start_floor,
    start_router,
    start_simulated_worker,
    status_kib,
    wait_until,
    write_json,
)
from bench.overhead_load import (
    BASELINE,
    MODES,
    STREAM_ITL_MS,
    STREAM_MODEL,
    STREAM_TTFT_MS,
    TINY_MODEL,
    CpuSample,
    Scenario,
    load_round,
    scenarios,
)
from bench.overhead_report import report
from bench.overhead_stats import RoundStats, idle_cpu_ms_per_s, round_stats, summarize

WORKERS_PER_SET = 4


# --------------------------------------------------------------------------- the benchmark


@dataclass
class Targets:
    direct: dict[str, list[str]]  # model -> worker base URLs
    router: str
    router_pid: int
    floor: str
    floor_pid: int
    worker_pids: list[int]
    baseline: str | None = None  # --baseline-tree: the router from that checkout
    baseline_pid: int | None = None

    @property
    def modes(self) -> tuple[str, ...]:
        return (*MODES, BASELINE) if self.baseline else MODES

    def sample(self) -> CpuSample:
        pids = (self.router_pid, self.floor_pid, self.worker_pids, self.baseline_pid)
        return CpuSample.take(*pids)


async def measure(
    targets: Targets, sc: Scenario, mode: str, requests: int
) -> tuple[RoundStats, float]:
    bases = {"direct": targets.direct[sc.model], "floor": [targets.floor]}
    if targets.baseline:
        bases[BASELINE] = [targets.baseline]
    urls = [u + "/v1/chat/completions" for u in bases.get(mode, [targets.router])]
    before = targets.sample()
    samples, wall = await load_round(urls, sc, requests)
    after = targets.sample()
    with_baseline = targets.baseline is not None
    return round_stats(mode, samples, wall, before, after, with_baseline), wall


def round_order(i: int, modes: tuple[str, ...] = MODES) -> tuple[str, ...]:
    """direct/floor/router, floor/router/direct, router/direct/floor, direct/floor/router, ...
    (with the baseline: direct/floor/router/baseline, floor/router/baseline/direct, ...)"""
    k = i % len(modes)
    return modes[k:] + modes[:k]


async def run_scenario(
    targets: Targets, sc: Scenario, rounds: int, fleet: Fleet
) -> tuple[dict[str, Any], list[dict[str, Any]], list[RoundStats]]:
    warmup = max(sc.concurrency * 4, 50) if not sc.stream else sc.concurrency * 2
    modes = targets.modes
    for mode in modes:
        await measure(targets, sc, mode, min(warmup, sc.requests))
    results: dict[str, list[RoundStats]] = {mode: [] for mode in modes}
    for i in range(rounds):
        for mode in round_order(i, modes):
            fleet.check_alive()
            stats, _ = await measure(targets, sc, mode, sc.requests)
            results[mode].append(stats)
            await asyncio.sleep(0.1)
        progress(sc, i, results)
    summary = summarize(sc, results)
    every = [r for mode in modes for r in results[mode]]
    return summary, [r.record() for r in every], every


def progress(sc: Scenario, i: int, results: dict[str, list[RoundStats]]) -> None:
    d, f, r = (results[mode][-1] for mode in MODES)
    print(
        f"  {sc.name:<20} round {i + 1}: direct {d.rps:7.1f} req/s p50 {d.p50_ms:6.2f} ms | "
        f"floor {f.rps:7.1f} req/s p50 {f.p50_ms:6.2f} ms cpu {f.floor_cpu_ms_per_req:.3f} | "
        f"router {r.rps:7.1f} req/s p50 {r.p50_ms:6.2f} ms cpu {r.router_cpu_ms_per_req:.3f}"
        + baseline_progress(results),
        file=sys.stderr,
        flush=True,
    )


def baseline_progress(results: dict[str, list[RoundStats]]) -> str:
    if BASELINE not in results:
        return ""
    b = results[BASELINE][-1]
    return (
        f" | baseline {b.rps:7.1f} req/s p50 {b.p50_ms:6.2f} ms "
        f"cpu {b.baseline_cpu_ms_per_req or 0.0:.3f}"
    )


async def start_fleet(fleet: Fleet, baseline_tree: Path | None) -> Targets:
    ports = free_ports(2 * WORKERS_PER_SET + 2)
    router_port, floor_port = ports[0], ports[1]
    tiny_ports = ports[2 : 2 + WORKERS_PER_SET]
    stream_ports = ports[2 + WORKERS_PER_SET :]
    for i, port in enumerate(tiny_ports):
        start_simulated_worker(fleet, f"tiny{i}", port, TINY_MODEL, ttft=0, itl=0)
    for i, port in enumerate(stream_ports):
        start_simulated_worker(
            fleet, f"stream{i}", port, STREAM_MODEL, STREAM_TTFT_MS, STREAM_ITL_MS
        )
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
    targets = Targets(
        direct=direct,
        router=router,
        router_pid=router_pid,
        floor=floor,
        floor_pid=floor_pid,
        worker_pids=[],
    )
    if baseline_tree is not None:
        await start_baseline(fleet, targets, baseline_tree, all_urls)
    proxies = ("router", "floor", BASELINE)
    targets.worker_pids = [proc.pid for name, proc in fleet.procs if name not in proxies]
    return targets


async def start_baseline(fleet: Fleet, targets: Targets, tree: Path, urls: list[str]) -> None:
    """The router again, from the checkout in `tree` (own database and var dir), with the same
    workers added through its POST /api/workers."""
    port = free_ports(1)[0]
    targets.baseline_pid = start_router(fleet, port, name=BASELINE, tree=tree)
    targets.baseline = base = f"http://{HOST}:{port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        await wait_until(
            f"{base}/health (baseline)", partial(http_ok, session, base + "/health"), fleet
        )
        await register_workers(session, fleet, base, urls, name=BASELINE)


def selected(args: argparse.Namespace) -> list[Scenario]:
    return [sc for sc in scenarios(args.quick) if not args.only or sc.name in args.only]


async def benchmark(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    also = f" and the baseline router from {args.baseline_tree}" if args.baseline_tree else ""
    workers = 2 * WORKERS_PER_SET
    log(f"starting {workers} simulated workers, the router and the floor proxy{also} ...")
    targets = await start_fleet(fleet, args.baseline_tree)
    base_rss_start = status_kib(targets.baseline_pid, "VmRSS") if targets.baseline_pid else 0
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
    result = {
        "scenarios": summaries,
        "memory": memory,
        "router_idle_cpu_ms_per_s": idle_cpu_ms_per_s(every, "router"),
        "floor_idle_cpu_ms_per_s": idle_cpu_ms_per_s(every, "floor"),
        "rounds_detail": details,
    }
    if targets.baseline_pid:
        memory["baseline_rss_start_mib"] = base_rss_start / 1024
        memory["baseline_peak_rss_mib"] = status_kib(targets.baseline_pid, "VmHWM") / 1024
        result["baseline_idle_cpu_ms_per_s"] = idle_cpu_ms_per_s(every, BASELINE)
    return result


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
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        metavar="DIR",
        help="also measure a router started from the checkout in DIR (mode 'baseline')",
    )
    args = parser.parse_args(argv)
    if args.baseline_tree is not None:
        args.baseline_tree = args.baseline_tree.resolve()
        if not (args.baseline_tree / "manage.py").is_file():
            parser.error(f"--baseline-tree {args.baseline_tree}: no manage.py there")
    if args.rounds is None:
        args.rounds = 3 if args.quick else 5
    if not 1 <= args.rounds <= 100:
        parser.error("--rounds must be between 1 and 100")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    measured = run_with_fleet(partial(benchmark, args))
    if measured is None:
        return 130
    result = {
        "machine": machine_info(),
        "config": {
            "rounds": args.rounds,
            "quick": args.quick,
            "only": args.only,
            "python": PYTHON,
            **({"baseline_tree": str(args.baseline_tree)} if args.baseline_tree else {}),
        },
        "duration_s": round(time.monotonic() - started, 1),
        **measured,
    }
    print(report(result))
    path = write_json("overhead", result)
    log(f"\nwrote {path.relative_to(ROOT)} ({result['duration_s']} s)")
    errors = sum(s["errors"] for s in result["scenarios"])
    if errors:
        log(f"WARNING: {errors} requests failed; the figures are suspect")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
