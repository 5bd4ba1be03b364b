"""What the control plane makes of GPU readings: which source counts, what is stale, and
when to warn. Pure functions of a worker row and new readings; the callers (the heartbeat
service and the probe round) write the fields and record the events.

* **One source at a time.** A worker with a DCGM exporter URL takes its readings from the
  exporter; the agent's NVML readings count only while the exporter has no fresh ones (not
  configured, or failing). So two sources never make the readings flap between each other.
* **Stale is unknown.** Readings older than :func:`stale_after` (the heartbeat expiry, and
  at least three probe intervals) are shown and exported as unknown, never as the last
  values, which may describe a GPU that has since gone.
* **Warnings.** A GPU at or above ``CONTROLPANEL_GPU_TEMP_WARN_C`` °C, with memory at or
  above ``CONTROLPANEL_GPU_MEMORY_WARN_PERCENT`` %, reporting an XID error (DCGM) or
  uncorrectable ECC errors, or a worker reporting fewer GPUs than the most it reported from
  the same source. Each warning has a key; an event is recorded only when a key appears or
  goes, not at every reading. Temperature and memory clear a little below their threshold
  (hysteresis), so a GPU hovering at the line does not fill the event log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings

from controlpanel.fleet.gpu import GpuReading
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Worker

NVML = "nvml"
DCGM = "dcgm"
TEMP_HYSTERESIS_C = 3.0
MEMORY_HYSTERESIS_PERCENT = 1.0
# The best-known XID codes (NVIDIA's XID catalogue), to make an event readable at 3 a.m.
XID_MEANINGS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
}

Warning = dict[str, str]  # {"key", "message"}


@dataclass(frozen=True)
class Limits:
    temp_c: float
    memory_percent: float

    @classmethod
    def from_settings(cls) -> Limits:
        return cls(
            temp_c=settings.CONTROLPANEL_GPU_TEMP_WARN_C,
            memory_percent=settings.CONTROLPANEL_GPU_MEMORY_WARN_PERCENT,
        )


@dataclass
class GpuChange:
    """The worker fields new readings set, and the events they call for (kind, message)."""

    fields: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)


def stale_after() -> float:
    return max(
        float(settings.CONTROLPANEL_HEARTBEAT_EXPIRY), 3 * settings.CONTROLPANEL_PROBE_INTERVAL
    )


def fresh_gpus(worker: Worker, now: datetime) -> list[GpuReading] | None:
    """The worker's readings while a source reports them, else None: unknown."""
    if not worker.gpus_source or worker.gpus_at is None:
        return None
    if (now - worker.gpus_at).total_seconds() > stale_after():
        return None
    return list(worker.gpus)


def accepts(worker: Worker, source: str, now: datetime) -> bool:
    if source == DCGM or not worker.dcgm_url:
        return True
    return worker.gpus_source != DCGM or fresh_gpus(worker, now) is None


def gpu_change(
    worker: Worker,
    *,
    gpus: list[GpuReading],
    source: str,
    now: datetime,
    limits: Limits | None = None,
) -> GpuChange:
    """What new readings from `source` change on the worker (nothing when the other source
    holds it)."""
    if not accepts(worker, source, now):
        return GpuChange()
    # Another source may see another set of GPUs (a node's exporter, a container's NVML):
    # a switch starts the count afresh rather than warning about "missing" GPUs.
    known = (worker.gpu_count_max or 0) if worker.gpus_source == source else 0
    count_max = max(known, len(gpus))
    active = {w["key"] for w in worker.gpu_warnings}
    warnings = evaluate(
        gpus, count_max=count_max, active=active, limits=limits or Limits.from_settings()
    )
    fields = {
        "gpus": gpus,
        "gpus_source": source,
        "gpus_at": now,
        "gpu_count_max": count_max,
        "gpu_warnings": warnings,
    }
    return GpuChange(fields=fields, events=warning_events(worker.gpu_warnings, warnings))


def gpu_forget() -> dict[str, Any]:
    """The fields that make a worker's GPUs unknown again (its exporter URL changed)."""
    return {
        "gpus": [],
        "gpus_source": "",
        "gpus_at": None,
        "gpu_count_max": None,
        "gpu_warnings": [],
    }


def evaluate(
    gpus: list[GpuReading], *, count_max: int, active: set[str], limits: Limits
) -> list[Warning]:
    """The warnings in force for these readings; `active` are the keys already in force,
    which clear only past the hysteresis margin."""
    found: list[Warning] = []
    for gpu in gpus:
        found += _gpu_warnings(gpu, active, limits)
    if len(gpus) < count_max:
        found.append(
            _warning(
                "count",
                f"{len(gpus)} of {count_max} GPUs report; one may have fallen off the bus",
            )
        )
    return found


def _gpu_warnings(gpu: GpuReading, active: set[str], limits: Limits) -> list[Warning]:
    name, ident = f"GPU {gpu['index']}", gpu["uuid"] or str(gpu["index"])
    found: list[Warning] = []
    temp, key = gpu["temp"], f"temp:{ident}"
    if temp is not None and temp >= limits.temp_c - (TEMP_HYSTERESIS_C if key in active else 0):
        found.append(_warning(key, f"{name} at {temp:.0f} °C (warning from {limits.temp_c:g} °C)"))
    percent, key = memory_percent(gpu), f"memory:{ident}"
    margin = MEMORY_HYSTERESIS_PERCENT if key in active else 0
    if percent is not None and percent >= limits.memory_percent - margin:
        message = f"{name} memory {percent:.1f}% full (warning from {limits.memory_percent:g}%)"
        found.append(_warning(key, message))
    if gpu["xid"]:
        meaning = XID_MEANINGS.get(gpu["xid"])
        detail = f": {meaning}" if meaning else ""
        found.append(_warning(f"xid:{ident}:{gpu['xid']}", f"{name} XID {gpu['xid']}{detail}"))
    if gpu["ecc_errors"]:
        message = f"{name} has {gpu['ecc_errors']} uncorrectable ECC error(s) since boot"
        found.append(_warning(f"ecc:{ident}", message))
    return found


def _warning(key: str, message: str) -> Warning:
    return {"key": key, "message": message}


def memory_percent(gpu: GpuReading) -> float | None:
    used, total = gpu.get("mem_used"), gpu.get("mem_total")
    if used is None or not total:
        return None
    return float(used) / float(total) * 100


def warning_events(before: list[Warning], after: list[Warning]) -> list[tuple[str, str]]:
    """One event per warning that appeared or went; none for one that stays."""
    old = {w["key"]: w["message"] for w in before}
    new = {w["key"]: w["message"] for w in after}
    raised = [(EventKind.GPU_WARNING.value, new[k]) for k in new if k not in old]
    cleared = [(EventKind.GPU_CLEARED.value, f"resolved: {old[k]}") for k in old if k not in new]
    return raised + cleared


def chart_points(gpus: list[GpuReading] | None) -> list[dict[str, Any]] | None:
    """What a history sample keeps of each GPU for the worker page's charts."""
    if gpus is None:
        return None
    return [
        {
            "index": g["index"],
            "util": g["util"],
            "mem": None if (p := memory_percent(g)) is None else p / 100,
            "temp": g["temp"],
            "power": g["power"],
        }
        for g in gpus
    ]
