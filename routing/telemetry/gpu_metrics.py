"""The fleet's GPUs on the router's /metrics, one series per worker and GPU.

Read from the snapshot's :class:`~routing.fleet.snapshot.WorkerView` (no database on the request
path), so only the router that exports the fleet gauges exports these, as routing.telemetry.metrics
explains. Labels: ``worker`` (as the other fleet gauges name it) and ``gpu`` (the GPU's
index on that worker). A reading the source does not report has no sample, and a worker
whose readings are stale or missing has none at all: never a made-up zero.

* `controlpanel_gpu_info{worker, gpu, uuid, name}`: always 1, to join the others on.
* `controlpanel_gpu_utilization`: fraction of time the GPU was busy (0..1).
* `controlpanel_gpu_memory_used_bytes`, `controlpanel_gpu_memory_total_bytes`.
* `controlpanel_gpu_temperature_celsius`, `controlpanel_gpu_power_watts`,
  `controlpanel_gpu_power_limit_watts`.
* `controlpanel_gpu_ecc_uncorrected_errors`: uncorrectable ECC errors since boot.
* `controlpanel_gpu_last_xid`: the last XID error code (0: none), from DCGM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from routing.fleet.snapshot import WorkerView

# GpuView attribute -> (metric name, help).
GPU_GAUGES = {
    "util": ("controlpanel_gpu_utilization", "Fraction of time the GPU was busy (0 to 1)."),
    "mem_used": ("controlpanel_gpu_memory_used_bytes", "GPU memory in use."),
    "mem_total": ("controlpanel_gpu_memory_total_bytes", "GPU memory in total."),
    "temp": ("controlpanel_gpu_temperature_celsius", "GPU temperature."),
    "power": ("controlpanel_gpu_power_watts", "GPU power draw."),
    "power_limit": ("controlpanel_gpu_power_limit_watts", "GPU power limit in force."),
    "ecc_errors": (
        "controlpanel_gpu_ecc_uncorrected_errors",
        "Uncorrectable ECC errors since the driver loaded.",
    ),
    "xid": ("controlpanel_gpu_last_xid", "The last XID error code the GPU reported (0: none)."),
}


def gpu_families(
    workers: Iterable[WorkerView], label: Callable[[int | None], str]
) -> Iterator[Metric]:
    workers = tuple(workers)
    info = GaugeMetricFamily(
        "controlpanel_gpu_info",
        "A worker's GPU, with its UUID and model name (always 1).",
        labels=["worker", "gpu", "uuid", "name"],
    )
    gauges = {
        key: GaugeMetricFamily(name, documentation, labels=["worker", "gpu"])
        for key, (name, documentation) in GPU_GAUGES.items()
    }
    for worker in workers:
        for gpu in worker.gpus:
            labels = [label(worker.id), str(gpu.index)]
            info.add_metric([*labels, gpu.uuid or "", gpu.name or ""], 1)
            for key, family in gauges.items():
                value = getattr(gpu, key)
                if value is not None:
                    family.add_metric(labels, value)
    yield info
    yield from gauges.values()
