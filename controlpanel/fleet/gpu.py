"""GPU readings from NVIDIA's own tools, in one shape whichever tool read them.

Two sources, either of which may be missing:

* **NVML**, read by the worker agent beside vLLM through NVIDIA's Python bindings
  (``nvidia-ml-py``, imported as ``pynvml``). :class:`NvmlReader` takes the module as an
  argument, so tests hand it a fake with recorded readings at exactly that call boundary.
* **A DCGM exporter** (NVIDIA's Prometheus exporter, the usual source on Kubernetes), scraped
  by the Celery probe. :func:`parse_dcgm` is a pure function of the exporter's text.

Both produce a list of :data:`GpuReading` dicts, one per GPU, sorted by index::

    {"index": 0, "uuid": "GPU-…", "name": "NVIDIA H100 80GB HBM3",
     "util": 0.73,            # fraction of time the GPU was busy, 0..1
     "mem_used": 69…, "mem_total": 85…,   # bytes
     "temp": 64.0,            # °C
     "power": 312.5, "power_limit": 700.0,  # W
     "ecc_errors": 0,         # uncorrectable ECC errors since the driver loaded
     "xid": 0}                # the last XID error code (0: none), DCGM only

A value the source does not report is None, never a made-up zero: a zero would read as
"idle" or "healthy". :func:`clean_gpus` is the one gate every reading passes before it is
stored (the agent's JSON included), so the shape and its size stay bounded.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

GpuReading = dict[str, Any]

# Bounds on what one worker may send: a big node has 8 or 16 GPUs; 32 leaves room.
MAX_GPUS = 32
MAX_TEXT = 96
NUMBER_FIELDS = ("util", "mem_used", "mem_total", "temp", "power", "power_limit")
COUNT_FIELDS = ("ecc_errors", "xid")
FIELDS = ("index", "uuid", "name", *NUMBER_FIELDS, *COUNT_FIELDS)
MIB = 1024 * 1024


def clean_gpus(raw: Any) -> list[GpuReading] | None:
    """Readings in the stored shape, or None when `raw` is not a list of GPUs at all.
    Unknown keys are dropped, bad numbers become None, at most MAX_GPUS are kept, and a
    GPU index seen twice keeps its first reading."""
    if not isinstance(raw, list):
        return None
    by_index: dict[int, GpuReading] = {}
    for item in raw:
        reading = _clean_one(item)
        if reading is not None:
            by_index.setdefault(reading["index"], reading)
    return [by_index[i] for i in sorted(by_index)][:MAX_GPUS]


def _clean_one(item: Any) -> GpuReading | None:
    if not isinstance(item, dict):
        return None
    index = _count(item.get("index"))
    if index is None:
        return None
    reading: GpuReading = {"index": index}
    reading["uuid"] = _text(item.get("uuid"))
    reading["name"] = _text(item.get("name"))
    for key in NUMBER_FIELDS:
        reading[key] = _number(item.get(key))
    if reading["util"] is not None:
        reading["util"] = min(reading["util"], 1.0)
    for key in COUNT_FIELDS:
        reading[key] = _count(item.get(key))
    return reading


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def _count(value: Any) -> int | None:
    number = _number(value)
    return None if number is None or number != int(number) else int(number)


def _text(value: Any) -> str | None:
    return value[:MAX_TEXT] if isinstance(value, str) and value else None


# --- NVML (the worker agent) -------------------------------------------------------------------


class NvmlReader:
    """Reads every GPU on this machine through NVML, for the agent's heartbeats.

    `nvml` is the ``pynvml`` module (imported lazily, so a machine without the package still
    runs the agent) or a test fake with the same functions and ``NVMLError``. When NVML
    cannot start (no driver, no GPU, no library) the reader says so once in the log and
    :meth:`read` returns None from then on: the agent sends no GPU block rather than zeros.
    Restart the agent after installing a driver.
    """

    def __init__(self, nvml: Any = None) -> None:
        self._nvml = nvml
        self._started: bool | None = None  # None: not tried yet

    def read(self) -> list[GpuReading] | None:
        if not self._start():
            return None
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            log.warning("NVML cannot count the GPUs: %s", exc)
            return None
        return clean_gpus([g for g in (self._read_device(i) for i in range(count)) if g])

    def _start(self) -> bool:
        if self._started is None:
            self._started = self._init()
        return self._started

    def _init(self) -> bool:
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            count = int(self._nvml.nvmlDeviceGetCount())
        except ImportError as exc:
            log.info("no GPU: cannot import pynvml (%s); heartbeats go without GPU readings", exc)
            return False
        except Exception as exc:  # noqa: BLE001 - any NVML failure means "no GPU here"
            log.info("no GPU: NVML is not available (%s); heartbeats go without GPU readings", exc)
            return False
        if count == 0:
            log.info("no GPU: NVML sees no device; heartbeats go without GPU readings")
            return False
        log.info("NVML sees %d GPU(s); sending their readings with each heartbeat", count)
        return True

    def _read_device(self, index: int) -> GpuReading | None:
        """One GPU; None when it cannot be reached at all (fallen off the bus), which the
        control plane then sees as a GPU fewer than before."""
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            log.warning("GPU %d cannot be read: %s", index, exc)
            return None
        field = self._field
        memory = field(nvml.nvmlDeviceGetMemoryInfo, handle)
        util = field(nvml.nvmlDeviceGetUtilizationRates, handle)
        return {
            "index": index,
            "uuid": field(nvml.nvmlDeviceGetUUID, handle),
            "name": field(nvml.nvmlDeviceGetName, handle),
            "util": None if util is None else util.gpu / 100,
            "mem_used": None if memory is None else memory.used,
            "mem_total": None if memory is None else memory.total,
            "temp": field(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
            "power": _watts(field(nvml.nvmlDeviceGetPowerUsage, handle)),
            "power_limit": _watts(field(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)),
            "ecc_errors": field(
                nvml.nvmlDeviceGetTotalEccErrors,
                handle,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            ),
        }

    def _field(self, call: Callable[..., Any], *args: Any) -> Any:
        # Consumer GPUs answer NotSupported for ECC, some boards for power: unknown, not 0.
        try:
            return call(*args)
        except self._nvml.NVMLError as exc:
            log.debug("NVML %s: %s", getattr(call, "__name__", call), exc)
            return None


def _watts(milliwatts: Any) -> float | None:
    return None if milliwatts is None else float(milliwatts) / 1000


# --- DCGM exporter (the probe) -----------------------------------------------------------------

# DCGM marks a field the GPU does not support with "blank" sentinels near the top of its
# integer range (DCGM_INT32_BLANK = 0x7ffffff0 and up); none of our readings comes close.
DCGM_BLANK = 0x7FFFFFF0
# Series -> (field, how several samples for one GPU combine: MIG instances report memory
# per instance, so memory adds up; the device-wide readings are the same in each).
DCGM_SERIES: dict[str, tuple[str, Callable[[list[float]], float]]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("util", max),
    "DCGM_FI_DEV_FB_USED": ("fb_used", sum),
    "DCGM_FI_DEV_FB_FREE": ("fb_free", sum),
    "DCGM_FI_DEV_FB_RESERVED": ("fb_reserved", sum),
    "DCGM_FI_DEV_GPU_TEMP": ("temp", max),
    "DCGM_FI_DEV_POWER_USAGE": ("power", max),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("power_limit", max),
    "DCGM_FI_DEV_XID_ERRORS": ("xid", max),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("ecc_errors", max),
}


def parse_dcgm(text: str) -> list[GpuReading] | None:
    """The GPUs in a DCGM exporter's /metrics text, keyed by its `gpu` label (the index),
    with `UUID` and `modelName` as it labels them; FB values are MiB, utilisation percent.
    None when the text is not Prometheus at all."""
    try:
        values, labels = _dcgm_samples(text)
    except ValueError:
        return None
    return clean_gpus([_dcgm_gpu(index, values[index], labels[index]) for index in values])


def _dcgm_samples(
    text: str,
) -> tuple[dict[int, dict[str, list[float]]], dict[int, dict[str, str]]]:
    values: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    labels: dict[int, dict[str, str]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # By family: the parser renames a counter's sample (ECC totals) to `…_total`.
            known = DCGM_SERIES.get(family.name) or DCGM_SERIES.get(sample.name)
            index = _count(_to_float(sample.labels.get("gpu")))
            if known is None or index is None:
                continue
            labels[index].update(sample.labels)
            value = float(sample.value)
            if math.isfinite(value) and 0 <= value < DCGM_BLANK:
                values[index][known[0]].append(value)
    return values, labels


def _to_float(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def _dcgm_gpu(index: int, series: dict[str, list[float]], labels: dict[str, str]) -> GpuReading:
    combined = {
        name: combine(series[name]) for name, combine in DCGM_SERIES.values() if series.get(name)
    }
    used, free = combined.get("fb_used"), combined.get("fb_free")
    total = None if used is None or free is None else used + free + combined.get("fb_reserved", 0)
    util = combined.get("util")
    return {
        "index": index,
        "uuid": labels.get("UUID"),
        "name": labels.get("modelName"),
        "util": None if util is None else util / 100,
        "mem_used": None if used is None else used * MIB,
        "mem_total": None if total is None else total * MIB,
        "temp": combined.get("temp"),
        "power": combined.get("power"),
        "power_limit": combined.get("power_limit"),
        "ecc_errors": _whole(combined.get("ecc_errors")),
        "xid": _whole(combined.get("xid")),
    }


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


def normalize_dcgm_url(url: str) -> str:
    """An http(s) URL, or "" for no exporter; a bare ``http://host:9400`` gets the
    exporter's ``/metrics`` path. Raises ValueError for anything else."""
    url = url.strip()
    if not url:
        return ""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL for a DCGM exporter: {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme.lower(), parts.netloc, path, parts.query, ""))
