"""Simulated GPUs for the simulated vLLM server, exported as NVIDIA's DCGM exporter does.

``simulate_vllm`` serves them at ``/dcgm-metrics``, so a worker pointed there shows live
GPU strips in the demo and the tests. The readings follow the engine's load: utilisation
moves towards the share of the batch that is busy (smoothed, as a real GPU's sampled
utilisation is), temperature and power follow utilisation, and memory sits where vLLM puts
it (about 90% reserved up front, a little more as the KV cache fills). A slow wave and a
little noise keep an idle server's readings changing, as a real idle GPU's do.

Test hooks (``POST /sim/control``): ``gpu_count`` hides GPUs (one fell off the bus),
``gpu_temp`` pins every GPU's temperature (null releases it), ``gpu_xid`` reports an
XID error code (0 clears it).
"""

from __future__ import annotations

import math
import random
import uuid

MODEL_NAME = "NVIDIA H100 80GB HBM3"
TOTAL_MIB = 81559
POWER_LIMIT_W = 700.0
IDLE_POWER_W = 70.0
IDLE_TEMP_C = 34.0
DRIVER = "550.54.15"
# (series, help) in the order and words of dcgm-exporter's default counters.
SERIES = (
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
)


class SimulatedGpus:
    def __init__(self, count: int, *, hostname: str = "sim-gpu-node") -> None:
        self.count = count
        self.hostname = hostname
        self.forced_temp: float | None = None
        self.xid = 0
        self._rng = random.Random()
        self._uuids = [f"GPU-{uuid.uuid4()}" for _ in range(count)]
        self._util = [0.0] * count

    def readings(self, *, load: float, kv_usage: float, now: float) -> list[dict[str, float]]:
        """One reading per visible GPU; `load` is the busy share of the batch (0..1)."""
        return [self._reading(i, load, kv_usage, now) for i in range(min(self.count, 64))]

    def _reading(self, index: int, load: float, kv_usage: float, now: float) -> dict[str, float]:
        wave = math.sin(now / 45 + index)  # a slow drift, one phase per GPU
        target = (0.25 + 0.7 * load if load > 0 else 0.03) + 0.03 * wave
        jitter = self._rng.uniform(-0.03, 0.03)
        util = min(1.0, max(0.0, 0.5 * self._util[index] + 0.5 * target + jitter))
        self._util[index] = util
        temp = IDLE_TEMP_C + 44 * util + 1.5 * wave + self._rng.uniform(-0.5, 0.5)
        used = TOTAL_MIB * (0.88 + 0.05 * kv_usage) + self._rng.uniform(-40, 40)
        if self.forced_temp is not None:
            temp = self.forced_temp
        return {
            "DCGM_FI_DEV_SM_CLOCK": 1980 if util > 0.05 else 345,
            "DCGM_FI_DEV_GPU_TEMP": round(temp),
            "DCGM_FI_DEV_POWER_USAGE": round(
                IDLE_POWER_W + (POWER_LIMIT_W - IDLE_POWER_W) * 0.85 * util, 3
            ),
            "DCGM_FI_DEV_GPU_UTIL": round(util * 100),
            "DCGM_FI_DEV_XID_ERRORS": self.xid,
            "DCGM_FI_DEV_FB_FREE": round(TOTAL_MIB - used),
            "DCGM_FI_DEV_FB_USED": round(used),
        }

    def render(self, *, load: float, kv_usage: float, now: float) -> str:
        """The exporter's text: every series with HELP and TYPE, one sample per GPU."""
        readings = self.readings(load=load, kv_usage=kv_usage, now=now)
        lines: list[str] = []
        for name, help_text in SERIES:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            lines += [f"{name}{{{self._labels(i)}}} {r[name]}" for i, r in enumerate(readings)]
        return "\n".join(lines) + "\n"

    def _labels(self, index: int) -> str:
        bus = f"00000000:{0x18 + index:02X}:00.0"
        return (
            f'gpu="{index}",UUID="{self._uuids[index]}",pci_bus_id="{bus}",device="nvidia{index}",'
            f'modelName="{MODEL_NAME}",Hostname="{self.hostname}",'
            f'DCGM_FI_DRIVER_VERSION="{DRIVER}"'
        )

    def control(self, data: dict[str, object]) -> None:
        """Apply the `/sim/control` GPU hooks present in `data`."""
        if "gpu_count" in data and isinstance(data["gpu_count"], int):
            self.count = max(0, min(data["gpu_count"], len(self._uuids)))
        if "gpu_temp" in data:
            value = data["gpu_temp"]
            self.forced_temp = float(value) if isinstance(value, int | float) else None
        if "gpu_xid" in data and isinstance(data["gpu_xid"], int):
            self.xid = data["gpu_xid"]
