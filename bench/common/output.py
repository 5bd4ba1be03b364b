"""A benchmark's output: progress on stderr, the machine for the report's header, percentiles,
and every figure as JSON in ``bench/out/<name>-<UTC timestamp>.json`` (git-ignored)."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

OUT_DIR = Path(__file__).resolve().parent.parent / "out"
# Above this share of the machine busy with processes outside the benchmark, reports warn.
OTHER_LOAD_WARN_PCT = 10.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of unsorted values."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def write_json(name: str, result: dict[str, Any]) -> Path:
    """bench/out/<name>-<UTC timestamp>.json; returns its path."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = OUT_DIR / f"{name}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path
