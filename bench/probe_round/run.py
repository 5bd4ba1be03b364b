"""What the control plane's probing costs a Celery worker while the fleet is idle (#29, item 4
"Idle costs nothing"): the CPU of one probe round and of one periodic tick, in-process.

    .venv/bin/python -m bench.probe_round [--workers 4] [--rounds 20] [--runs 5]
    .venv/bin/python -m bench.probe_round --quick      # 1 run of 5 rounds, a smoke run

* **What runs:** ``--workers`` simulated vLLM workers (``manage.py simulate_vllm``, harness.fleet)
  and, in this process, Django on the fleet's throw-away SQLite database (migrated here), the
  workers added as an operator adds them (``services.worker_add``), no traffic.
* **Measured** (``time.process_time``: this process's CPU, the workers' is theirs), after
  ``--warmup`` rounds of each: **the probe round**, ``probes.probe_many`` over
  ``health.probe_targets()`` as ``health.workers_probe`` calls it (the I/O and nothing of the
  database), and **the periodic tick**, ``controlpanel.celery.periodic`` called directly with
  the task names beat sends at the probe interval (the probe round, applying its results,
  history, preflight, and whatever else runs at that interval). Each is the median over
  ``--runs`` runs of the mean CPU ms per round over ``--rounds`` rounds, ``--gap`` seconds
  apart (sleeping costs no CPU; a real round is CONTROLPANEL_PROBE_INTERVAL apart).

Output: a markdown table on stdout, progress on stderr, ``bench/out/probe-round-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from bench.common.output import OUT_DIR, log, machine_info, write_json
from harness.fleet import HOST, Fleet, start_simulated_worker
from harness.processes import free_ports, http_answers, wait_until

MODEL = "probe-round-model"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=(__doc__ or "").split("\n", 1)[0]
    )
    parser.add_argument("--workers", type=int, default=4, help="simulated workers probed")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per measured run")
    parser.add_argument("--runs", type=int, default=5, help="measured runs (median)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured rounds first")
    parser.add_argument("--gap", type=float, default=0.2, help="seconds between rounds")
    parser.add_argument("--quick", action="store_true", help="1 run of 5 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.rounds, args.warmup = 1, 5, 1
    return args


def start_workers(fleet: Fleet, count: int) -> list[str]:
    ports = free_ports(count)
    for i, port in enumerate(ports):
        start_simulated_worker(fleet, f"worker-{i + 1}", port, MODEL, ttft=20, itl=10)
    for port in ports:
        wait_until(partial(_answers, fleet, port))
    return [f"http://{HOST}:{port}" for port in ports]


def _answers(fleet: Fleet, port: int) -> bool:
    fleet.check_alive()  # a worker that died fails now, not at the ceiling
    return http_answers(HOST, port, "/health")


def setup_django(fleet: Fleet, urls: list[str]) -> None:
    """Django in this process on the fleet's database, as a Celery worker runs it."""
    for key in ("REDIS_URL",):
        os.environ.pop(key, None)
    for key in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "CONTROLPANEL_VAR_DIR"):
        os.environ[key] = fleet.env[key]
    import django

    django.setup()
    from django.core.management import call_command

    from controlpanel.fleet import services

    call_command("migrate", verbosity=0, interactive=False)
    for i, url in enumerate(urls):
        services.worker_add(url=url, name=f"worker-{i + 1}", actor="bench")


def cpu_ms_per_round(action: Callable[[], object], rounds: int, gap: float) -> float:
    spent = 0.0
    for _ in range(rounds):
        started = time.process_time()
        action()
        spent += time.process_time() - started
        time.sleep(gap)
    return spent / rounds * 1000


def actions() -> dict[str, Callable[[], object]]:
    """The two measured things: the probe round's I/O, and the periodic tick beat sends."""
    from django.conf import settings

    from controlpanel.celery import app, periodic
    from controlpanel.fleet import health, probes

    app.loader.import_default_modules()  # the tasks' modules, as a Celery worker loads them

    names = next(
        entry["args"][0]
        for entry in settings.CELERY_BEAT_SCHEDULE.values()
        if "controlpanel.probe_workers" in entry["args"][0]
    )
    timeout = settings.CONTROLPANEL_PROBE_TIMEOUT

    def probe_round() -> object:
        results = probes.probe_many(health.probe_targets(), timeout=timeout)
        assert all(r.up for r in results), [r.error for r in results]
        return results

    return {"probe round": probe_round, "periodic tick": lambda: periodic(names)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for name, action in actions().items():
        cpu_ms_per_round(action, args.warmup, args.gap)
        runs = []
        for run in range(args.runs):
            runs.append(cpu_ms_per_round(action, args.rounds, args.gap))
            log(f"{name}: run {run + 1} of {args.runs}: {runs[-1]:.2f} CPU ms per round")
        figures[name] = {"median_ms": statistics.median(runs), "runs_ms": runs}
    return figures


def report(result: dict[str, Any]) -> str:
    config = result["config"]
    lines = [
        f"machine: {result['machine']}",
        "",
        f"{config['workers']} idle simulated workers; median of {config['runs']} runs of "
        f"{config['rounds']} rounds, {config['gap']:g} s apart",
        "",
        "| measured | CPU ms per round (median) | runs (ms) |",
        "|---|--:|---|",
    ]
    for name, figure in result["figures"].items():
        runs = ", ".join(f"{ms:.2f}" for ms in figure["runs_ms"])
        lines.append(f"| {name} | {figure['median_ms']:.2f} | {runs} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fleet = Fleet()
    try:
        urls = start_workers(fleet, args.workers)
        log(f"{len(urls)} simulated workers up; migrating the throw-away database")
        setup_django(fleet, urls)
        figures = measure(args)
    except KeyboardInterrupt:
        log("interrupted; stopping the workers")
        return 130
    finally:
        fleet.stop()
    config = {k: v for k, v in vars(args).items() if k != "quick"}
    result = {"machine": machine_info(), "config": config, "figures": figures}
    path = write_json("probe-round", result)
    print(report(result))
    log(f"figures: {path.relative_to(OUT_DIR.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
