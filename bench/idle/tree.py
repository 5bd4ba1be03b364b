"""The processes of a serve tree, read from ``/proc``: who descends from a pid, what each one
is (supervisor, router, Celery, ...), and its CPU time, per thread too, over a window.

A library of ``bench.idle``; the standard library and :mod:`harness.procfs` only.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.procfs import CLK_TCK, cpu_times, status_kib


@dataclass
class Sample:
    """One process's CPU seconds (utime + stime) now, and each of its threads' by name."""

    pid: int
    role: str
    cpu_s: float
    threads: dict[str, float] = field(default_factory=dict)


def parent_of(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[1])


def descendants(root: int) -> list[int]:
    """root and every process below it, root first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError):
                children.setdefault(parent_of(int(entry)), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return found


def role(pid: int) -> str:
    """A short name for what the process runs, from its command line."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    line = " ".join(args)
    for needle, name in (
        ("launcher.router", "router"),
        ("-m launcher", "supervisor"),
        ("celery", "celery"),
        ("simulate_vllm", "worker"),
        ("worker_agent", "agent"),
        ("manage.py serve", "serve"),
    ):
        if needle in line:
            return name
    return Path(args[0]).name if args and args[0] else "?"


def thread_times(pid: int) -> dict[str, float]:
    """CPU seconds of each thread, by ``name:tid`` (a thread's comm is its Python name's
    first 15 bytes, for threads that name themselves)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            comm = raw[raw.index("(") + 1 : raw.rindex(")")]
            fields = raw[raw.rindex(")") + 2 :].split()
            out[f"{comm}:{tid}"] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def sample(pids: list[int]) -> dict[int, Sample]:
    """What every pid still running has used so far."""
    out: dict[int, Sample] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            out[pid] = Sample(pid, role(pid), sum(cpu_times(pid)), thread_times(pid))
    return out


def memory_mib(pid: int) -> dict[str, float]:
    """Resident now and at its peak (VmRSS, VmHWM), in MiB; empty when the process is gone."""
    try:
        return {key: status_kib(pid, key) / 1024 for key in ("VmRSS", "VmHWM")}
    except (OSError, KeyError):
        return {}


def window(
    before: dict[int, Sample], after: dict[int, Sample], seconds: float
) -> list[dict[str, Any]]:
    """Per process, the CPU used between two samples as % of one core, with its busiest
    threads; a process that started meanwhile counts from its start."""
    rows = []
    for pid, end in after.items():
        start = before.get(pid)
        used = end.cpu_s - (start.cpu_s if start else 0.0)
        threads = {
            name: secs - (start.threads.get(name, 0.0) if start else 0.0)
            for name, secs in end.threads.items()
        }
        busy = {n: round(100 * s / seconds, 3) for n, s in threads.items() if s > 0}
        rows.append({
            "pid": pid, "role": end.role, "new": start is None,
            "cpu_s": round(used, 3), "core_pct": round(100 * used / seconds, 3),
            "threads_core_pct": dict(sorted(busy.items(), key=lambda kv: -kv[1])),
            **{k.lower() + "_mib": round(v, 1) for k, v in memory_mib(pid).items()},
        })  # fmt: skip
    return rows
