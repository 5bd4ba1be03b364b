"""What does the router cost? Direct-to-workers, stack floor, router and its peers, in one run.

Set-up: two sets of four simulated vLLM workers (``manage.py simulate_vllm``), each set serving
one model: ``bench-tiny`` answers at once (ttft 0, itl 0) and ``bench-stream`` behaves like a
small GPU server (ttft 20 ms, itl 5 ms). One router (uvicorn serving ``controlpanel.asgi``) runs
on a throw-away SQLite database with all eight workers registered through the admin API. One
floor proxy (``bench/common/floor_proxy.py``, same uvicorn flags) forwards to the same eight
workers, round-robin per model, and does nothing else: it is the measured lower bound of "uvicorn +
aiohttp client" on this machine, so router CPU minus floor CPU is the router's own cost. This
script is the load generator, a separate process from the router and the workers: aiohttp on
uvloop, one ``ClientSession`` with ``TCPConnector(limit=concurrency)`` per round, pre-encoded
bodies, closed loop (``concurrency`` clients, each sending its next request as soon as the
previous answer is read to the end).

Method:

* **Scenarios.** One-token requests at 1, 32 and 128 clients (``tiny``), 64-token streams at
  32 (``stream``) and ``prefix``: about 4,000 words a prompt (a 3,000-word system prompt all
  share and 1,000 words of each prompt's own, 64 seeded prompts in turn), not streamed,
  ``max_tokens`` 1, 32 clients, on the ``bench-tiny`` workers.
* **Interleaving.** Every scenario runs ``--rounds`` rounds; each round measures every mode
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
* **Router under granian** (``--granian``). Mode ``router-granian``: the same
  ``controlpanel.asgi`` app, environment and workers, served by granian (``--interface asgi
  --workers 1 --loop uvloop --no-access-log``) on its own throw-away database; its CPU and RSS
  are its supervisor's and its worker's together.
* **The floor with another upstream client** (``--floor-raw``). Mode ``floor-raw``:
  ``bench/common/floor_raw_proxy.py``, the floor proxy with aiohttp's client replaced by a
  minimal HTTP/1.1 client (asyncio protocol, httptools' parser, a keep-alive pool), same
  uvicorn command and upstreams: how much of the floor is the upstream client (a lower bound:
  no timeouts, no flow control, no TLS).
* **The Rust routers** (``--peers``, default ``vllm-router,sglang-router``; ``none`` skips
  them). ``vllm-router`` 0.1.17 and ``sglang-router`` 0.3.2 (``harness/rust_routers.py``
  installs them once per machine into ``~/.cache/controlpanel/rust-routers-<hash>``), round
  robin, log level warning. Their workers must all serve one model, so each runs one instance
  per model; a round reads the CPU of the instance serving its scenario (the other's counts
  with the workers), and the peak RSS is the larger instance's. One that cannot be installed
  or started is left out and the report says why.
* **Targets.** The first issue's (PASS/FAIL) and issue #29's (met / not met, from the
  medians): router CPU per tiny request (c=32) <= vllm-router's, per stream and per prefix
  request <= 1.2 x the floor's, added TTFT p50 <= vllm-router's + 0.5 ms, router peak RSS <=
  100 MiB.
* **Quiet machine check.** Busy time from ``/proc/stat`` minus the CPU of the router, the floor
  proxy, the workers and this script is "other load"; above 10 % of the machine the report
  warns that the figures are unreliable.

Usage: ``.venv/bin/python -m bench.overhead [--rounds N] [--quick] [--only SCENARIO]
[--baseline-tree DIR] [--granian] [--floor-raw] [--peers vllm-router,sglang-router | none]``.
Prints a markdown report and writes the figures, with per-round detail, to
``bench/out/overhead-<timestamp>.json``.
All traffic stays on 127.0.0.1; all subprocesses are stopped on exit, error or Ctrl-C.

This script starts the fleet and runs the rounds; the scenarios, modes and load generator are
in ``bench/overhead/load.py``, the per-round figures and medians in ``bench/overhead/stats.py``,
the report in ``bench/overhead/report.py`` and its targets in ``bench/overhead/targets.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from bench.common.floor import start_floor
from bench.common.output import log, machine_info, write_json
from bench.common.router_api import http_ok, post_ok, register_workers, set_model_policy
from bench.overhead.load import (
    ALL_MODES,
    BASELINE,
    FLOOR_RAW,
    GRANIAN,
    PEERS,
    STREAM_ITL_MS,
    STREAM_MODEL,
    STREAM_TTFT_MS,
    TINY_MODEL,
    CpuSample,
    Scenario,
    key,
    load_round,
    scenarios,
)
from bench.overhead.report import report
from bench.overhead.stats import RoundStats, idle_cpu_ms_per_s, round_stats, summarize
from harness.fleet import (
    HOST,
    PYTHON,
    ROOT,
    Fleet,
    run_with_fleet,
    start_router,
    start_simulated_worker,
    wait_ready,
)
from harness.processes import free_ports
from harness.procfs import process_tree, status_kib
from harness.rust_routers import peer_args, peer_commands

WORKERS_PER_SET = 4
PEER_READY_S = 60.0
MODELS = (TINY_MODEL, STREAM_MODEL)


# --------------------------------------------------------------------------- the benchmark


@dataclass
class Proxy:
    """A proxy mode: its base URL per model, and the pids of the process tree serving each
    model (the router's one uvicorn process serves both; a Rust router has one instance per
    model)."""

    urls: dict[str, str]
    pids: dict[str, list[int]]

    @classmethod
    def single(cls, url: str, pid: int) -> Proxy:
        tree = process_tree(pid)
        return cls({m: url for m in MODELS}, {m: tree for m in MODELS})

    def peak_rss_mib(self) -> float:
        """The largest instance's VmHWM, summed over its processes."""
        instances = {tuple(pids) for pids in self.pids.values()}
        return max(sum(status_kib(p, "VmHWM") for p in pids) for pids in instances) / 1024


@dataclass
class Targets:
    direct: dict[str, list[str]]  # model -> worker base URLs
    proxies: dict[str, Proxy]  # mode -> its servers
    worker_pids: list[int] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # mode -> why it did not run

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(m for m in ALL_MODES if m == "direct" or m in self.proxies)

    def sample(self, model: str) -> CpuSample:
        serving = {mode: proxy.pids[model] for mode, proxy in self.proxies.items()}
        mine = {pid for pids in serving.values() for pid in pids}
        rest = {p for proxy in self.proxies.values() for ps in proxy.pids.values() for p in ps}
        return CpuSample.take(serving, [*self.worker_pids, *(rest - mine)])


async def measure(targets: Targets, sc: Scenario, mode: str, requests: int) -> RoundStats:
    bases = targets.direct[sc.model] if mode == "direct" else [targets.proxies[mode].urls[sc.model]]
    urls = [u + "/v1/chat/completions" for u in bases]
    before = targets.sample(sc.model)
    samples, wall = await load_round(urls, sc, requests)
    after = targets.sample(sc.model)
    return round_stats(mode, samples, wall, before, after)


def round_order(i: int, modes: tuple[str, ...]) -> tuple[str, ...]:
    """direct/floor/router, floor/router/direct, router/direct/floor, direct/floor/router, ...
    (with more modes, the same rotation over all of them)."""
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
            results[mode].append(await measure(targets, sc, mode, sc.requests))
            await asyncio.sleep(0.1)
        progress(sc, i, results)
    summary = summarize(sc, results)
    every = [r for mode in modes for r in results[mode]]
    return summary, [r.record() for r in every], every


def progress(sc: Scenario, i: int, results: dict[str, list[RoundStats]]) -> None:
    parts = []
    for mode, rounds in results.items():
        r = rounds[-1]
        cpu = "" if r.cpu_ms_per_req is None else f" cpu {r.cpu_ms_per_req:.3f}"
        parts.append(f"{mode} {r.rps:.0f} req/s p50 {r.p50_ms:.2f} ms{cpu}")
    print(f"  {sc.name:<20} round {i + 1}: " + " | ".join(parts), file=sys.stderr, flush=True)


# The floor proxies a run starts: the floor, and with --floor-raw its variant.
FLOOR_MODULES = {"floor": "bench.common.floor_proxy", FLOOR_RAW: "bench.common.floor_raw_proxy"}


async def start_fleet(fleet: Fleet, args: argparse.Namespace) -> Targets:
    ports = free_ports(2 * WORKERS_PER_SET + 1)
    router_port = ports[0]
    tiny_ports = ports[1 : 1 + WORKERS_PER_SET]
    stream_ports = ports[1 + WORKERS_PER_SET :]
    for i, port in enumerate(tiny_ports):
        start_simulated_worker(fleet, f"tiny{i}", port, TINY_MODEL, ttft=0, itl=0)
    for i, port in enumerate(stream_ports):
        start_simulated_worker(
            fleet, f"stream{i}", port, STREAM_MODEL, STREAM_TTFT_MS, STREAM_ITL_MS
        )
    worker_pids = [c.pid for c in fleet.procs]
    router_pid = start_router(fleet, router_port)
    router = f"http://{HOST}:{router_port}"
    direct = {
        TINY_MODEL: [f"http://{HOST}:{p}" for p in tiny_ports],
        STREAM_MODEL: [f"http://{HOST}:{p}" for p in stream_ports],
    }
    floors = [name for name in FLOOR_MODULES if name == "floor" or args.floor_raw]
    floor_urls: dict[str, tuple[str, int]] = {}
    for name, port in zip(floors, free_ports(len(floors)), strict=True):
        pid = start_floor(fleet, port, direct, name, FLOOR_MODULES[name])
        floor_urls[name] = (f"http://{HOST}:{port}", pid)
    all_urls = direct[TINY_MODEL] + direct[STREAM_MODEL]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in [*all_urls, router]:
            await wait_ready(f"{url}/health", partial(http_ok, session, url + "/health"), fleet)
        for name, (url, _) in floor_urls.items():
            await wait_ready(f"{url} ({name})", partial(probe, session, url, TINY_MODEL), fleet)
        await register_workers(session, fleet, router, all_urls)
        if args.router_policy:
            await set_model_policy(session, fleet, router, list(MODELS), args.router_policy)
    proxies = {name: Proxy.single(url, pid) for name, (url, pid) in floor_urls.items()}
    proxies["router"] = Proxy.single(router, router_pid)
    targets = Targets(direct=direct, proxies=proxies, worker_pids=worker_pids)
    policy = args.router_policy
    if args.baseline_tree is not None:
        await start_router_mode(
            fleet, targets, all_urls, BASELINE, tree=args.baseline_tree, policy=policy
        )
    if args.granian:
        await start_router_mode(fleet, targets, all_urls, GRANIAN, server="granian", policy=policy)
    for name in args.peers:
        if isinstance(command := args.peer_commands[name], str):
            targets.unavailable[name] = command
        else:
            await start_peer(fleet, targets, name, command)
    return targets


async def probe(session: aiohttp.ClientSession, base: str, model: str) -> bool:
    """One request of `model` through `base` answers 200."""
    body = Scenario("probe", model, 1, 1, stream=False).body()
    return await post_ok(session, base + "/v1/chat/completions", body)


async def start_router_mode(
    fleet: Fleet,
    targets: Targets,
    urls: list[str],
    mode: str,
    tree: Path = ROOT,
    server: str = "uvicorn",
    policy: str | None = None,
) -> None:
    """The router again as mode `mode`: from the checkout in `tree`, or served by `server`;
    its own database and var dir, the same workers added through its POST /api/workers (and
    the models' policy set to `policy`, if given)."""
    port = free_ports(1)[0]
    pid = start_router(fleet, port, name=mode, tree=tree, server=server)
    base = f"http://{HOST}:{port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        await wait_ready(
            f"{base}/health ({mode})", partial(http_ok, session, base + "/health"), fleet
        )
        await register_workers(session, fleet, base, urls, name=mode)
        if policy:
            await set_model_policy(session, fleet, base, list(MODELS), policy)
        for model in MODELS:  # and it answers (granian's worker is up)
            await wait_ready(
                f"{base} ({mode}, {model})", partial(probe, session, base, model), fleet
            )
    targets.proxies[mode] = Proxy.single(base, pid)


async def start_peer(fleet: Fleet, targets: Targets, name: str, command: Path) -> None:
    """A Rust router per model, in front of that model's workers; if one does not start, the
    mode is left out and the reason kept for the report."""
    proxy = Proxy({}, {})
    names = [f"{name}-{model}" for model in MODELS]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            for child, model in zip(names, MODELS, strict=True):
                port, metrics = free_ports(2)
                args = peer_args(name, command, HOST, (port, metrics), targets.direct[model])
                pid = fleet.spawn(child, args).pid
                base = f"http://{HOST}:{port}"
                check = partial(probe, session, base, model)
                await wait_ready(f"{base} ({child})", check, fleet, timeout=PEER_READY_S)
                proxy.urls[model], proxy.pids[model] = base, process_tree(pid)
    except RuntimeError as exc:
        started = [c for c in fleet.procs if c.name in names]
        tails = " ".join(f"{c.name}: {c.log_tail(3)}" for c in started).replace("\n", " ")
        fleet.stop_named(names)
        targets.unavailable[name] = f"it did not start ({exc}). {tails}".strip()[:600]
        log(f"{name}: not measured: {targets.unavailable[name]}")
        return
    targets.proxies[name] = proxy


def selected(args: argparse.Namespace) -> list[Scenario]:
    named = scenarios(args.quick, opt_in=bool(args.only))
    return [sc for sc in named if not args.only or sc.name in args.only]


async def benchmark(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    workers = 2 * WORKERS_PER_SET
    others = [
        *([FLOOR_RAW] if args.floor_raw else []),
        *([BASELINE] if args.baseline_tree else []),
        *([GRANIAN] if args.granian else []),
    ]
    also = "".join(f", {m}" for m in [*others, *args.peers])
    log(f"starting {workers} simulated workers, the router, the floor proxy{also} ...")
    targets = await start_fleet(fleet, args)
    router = targets.proxies["router"].pids[TINY_MODEL][0]
    rss_start = status_kib(router, "VmRSS")
    summaries, details, every = [], {}, []
    for sc in selected(args):
        log(f"scenario {sc.name}: {args.rounds} rounds x {sc.requests} requests per mode")
        summary, detail, rounds = await run_scenario(targets, sc, args.rounds, fleet)
        summaries.append(summary)
        details[sc.name] = detail
        every += rounds
    memory = {
        "router_rss_start_mib": rss_start / 1024,
        "router_rss_end_mib": status_kib(router, "VmRSS") / 1024,
        **{f"{key(m)}_peak_rss_mib": p.peak_rss_mib() for m, p in targets.proxies.items()},
    }
    proxies = [m for m in targets.modes if m != "direct"]
    return {
        "modes": list(targets.modes),
        "unavailable": targets.unavailable,
        "scenarios": summaries,
        "memory": memory,
        "idle_cpu_ms_per_s": {m: idle_cpu_ms_per_s(every, m) for m in proxies},
        "rounds_detail": details,
    }


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds per scenario (5)")
    parser.add_argument("--quick", action="store_true", help="few requests: a ~40 s smoke run")
    parser.add_argument(
        "--only",
        action="append",
        metavar="SCENARIO",
        choices=[sc.name for sc in scenarios(quick=False, opt_in=True)],
        help="run only this scenario (repeatable), e.g. --only 'tiny c=32'; "
        "'stream 64 tok c=1' and 'stream 64 tok c=8' run only when named",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        metavar="DIR",
        help="also measure a router started from the checkout in DIR (mode 'baseline')",
    )
    parser.add_argument(
        "--granian",
        action="store_true",
        help=f"also measure the router served by granian (mode '{GRANIAN}')",
    )
    parser.add_argument(
        "--floor-raw",
        action="store_true",
        help=f"also measure the floor proxy with a minimal httptools upstream client instead "
        f"of aiohttp (mode '{FLOOR_RAW}', bench/common/floor_raw_proxy.py)",
    )
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        metavar="NAMES",
        help=f"Rust routers to measure too, comma-separated, or 'none' ({','.join(PEERS)})",
    )
    parser.add_argument(
        "--router-policy",
        metavar="POLICY",
        help="the routers' policy for both models (default: the router's, shortest_queue); "
        "round_robin routes as the floor and the Rust routers here do",
    )
    args = parser.parse_args(argv)
    args.peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p]
    if unknown := [p for p in args.peers if p not in PEERS]:
        parser.error(f"--peers: unknown {', '.join(unknown)}; known: {', '.join(PEERS)}")
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
    # Installed (once per machine) before the fleet starts; a failure is reported, not fatal.
    args.peer_commands = peer_commands(args.peers)
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
            "granian": args.granian,
            "floor_raw": args.floor_raw,
            "peers": args.peers,
            "router_policy": args.router_policy or "default",
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
