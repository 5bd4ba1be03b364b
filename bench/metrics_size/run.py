"""How big the router's /metrics gets with N workers, vLLM's own series re-exported included.

    .venv/bin/python -m bench.metrics_size [--workers 100] [--rounds 5]

One simulated vLLM worker (simulator/) serves a few requests so its histograms have counts;
its /metrics page is parsed the way the control plane's probe keeps it
(routing.telemetry.vllm_metrics.kept_series) and given, with the curated values, to N workers of an
in-process router's snapshot. The router then renders its /metrics page as a scrape would
(RouterApp.render_metrics). Printed: the page's bytes and lines, the share of `vllm:` lines,
bytes per worker, the median render time, and the worst case the per-worker cap allows
(MAX_SAMPLES_PER_WORKER samples of the measured average line length), and the same fleet
without vLLM's series for comparison. Nothing is started
outside this process; the figures depend only on the simulator's page and the router code.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

# For `python -m bench.metrics_size` from anywhere: the project's packages by path.
from bench.common.workers import worker_view
from routing.fleet.snapshot import GpuView, ModelEntry, WorkerView, build_snapshot
from routing.router import RouterApp
from routing.telemetry.vllm_metrics import MAX_SAMPLES_PER_WORKER, SERIES_KEY, kept_series
from simulator.config import SimConfig
from simulator.server import start_simulator

MODEL = "llama-3.1-8b-instruct"
CURATED = {"running": 3, "waiting": 1, "kv_cache_usage": 0.4, "prefix_hit_rate": 0.6,
           "ttft_p50": 0.08, "ttft_p95": 0.2, "rps": 4.0}  # fmt: skip


async def worker_page(requests: int) -> str:
    """A simulated worker's /metrics after `requests` small completions."""
    sim = await start_simulator(SimConfig(model=MODEL, ttft_ms=1, itl_ms=1))
    try:
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as client:
            body = {"model": MODEL, "prompt": "hello " * 40, "max_tokens": 8}
            for _ in range(requests):
                (await client.post("/v1/completions", json=body)).raise_for_status()
            return (await client.get("/metrics")).text
    finally:
        await sim.stop()


def fleet(count: int, page: str | None) -> list[WorkerView]:
    """`count` workers with the curated values, and vLLM's series from `page` unless None."""
    series = kept_series(text_string_to_metric_families(page)) if page is not None else None
    return [
        worker_view(
            i,
            name=f"gpu-{i}",
            url=f"http://10.0.{i // 250}.{i % 250}:8000",
            source="agent",
            models=(ModelEntry(id=MODEL),),
            queue_length=4,
            last_heartbeat=time.time(),
            metrics={**CURATED, SERIES_KEY: series} if series else dict(CURATED),
            gpus=(GpuView(index=0, uuid=f"GPU-{i}", name="NVIDIA H100", util=0.5, temp=60.0),),
        )
        for i in range(1, count + 1)
    ]


def measure(workers: list[WorkerView], rounds: int) -> tuple[bytes, float]:
    app = RouterApp()
    app.install(build_snapshot(workers=workers, served_models=(), generation=1))
    times, page = [], b""
    for _ in range(rounds):
        started = time.perf_counter()
        page = app.render_metrics()
        times.append(time.perf_counter() - started)
    return page, statistics.median(times)


def report(page: bytes, seconds: float, workers: int) -> None:
    lines = [line for line in page.decode().splitlines() if line and not line.startswith("#")]
    vllm = [line for line in lines if line.startswith("vllm:")]
    vllm_bytes = sum(len(line) + 1 for line in vllm)
    per_sample = vllm_bytes / max(1, len(vllm))
    worst = workers * MAX_SAMPLES_PER_WORKER * per_sample
    print(f"workers: {workers}")
    print(f"/metrics: {len(page):,} bytes, {len(lines):,} samples, "
          f"rendered in {seconds * 1e3:.1f} ms (median)")  # fmt: skip
    print(f"vllm: samples: {len(vllm):,} ({len(vllm) // workers} per worker), "
          f"{vllm_bytes:,} bytes ({vllm_bytes / len(page):.0%} of the page)")  # fmt: skip
    print(f"bytes per worker: {len(page) / workers:,.0f}")
    print(f"cap: {MAX_SAMPLES_PER_WORKER} vllm: samples per worker; at {per_sample:.0f} bytes a "
          f"sample, at most {worst / 1e6:.1f} MB of vllm: lines for {workers} workers")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20, help="served before the scrape")
    args = parser.parse_args()
    page = asyncio.run(worker_page(args.requests))
    rendered, seconds = measure(fleet(args.workers, page), args.rounds)
    report(rendered, seconds, args.workers)
    curated, curated_seconds = measure(fleet(args.workers, None), args.rounds)
    print(f"without vLLM's series: {len(curated):,} bytes, rendered in "
          f"{curated_seconds * 1e3:.1f} ms (median)")  # fmt: skip
    return 0
