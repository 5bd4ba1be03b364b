"""GPU telemetry, layer by layer, without a GPU: the NVML mapping on recorded readings (a
fake at the pynvml call boundary), the DCGM parser on an exporter's text, the warnings,
the simulator's exporter and the /metrics families."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from controlpanel.console.gpu_dashboard import fixed_scale_points, gpu_strip
from controlpanel.fleet import gpu, gpu_health
from controlpanel.fleet.agent import Agent
from controlpanel.fleet.gpu import MIB, NvmlReader, clean_gpus, normalize_dcgm_url, parse_dcgm
from controlpanel.fleet.gpu_health import DCGM, NVML, Limits, evaluate, gpu_change
from controlpanel.registry.models import Worker
from routing.fleet.snapshot import GpuView, ModelEntry, WorkerView, build_snapshot
from routing.router import RouterApp
from simulator.gpus import SimulatedGpus
from tests.support.common import DATA
from tests.support.gpu import GIB, reading
from tests.support.metrics import parse, value

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
LIMITS = Limits(temp_c=85, memory_percent=98)


def nvml_error(code: int) -> pynvml.NVMLError:
    # pynvml maps a return code to its own exception subclass, as the real calls raise.
    return pynvml.NVMLError(code)


# --- NVML: recorded readings behind a fake pynvml ------------------------------------------

# Two A100s as nvidia-smi showed them on a busy vLLM node, then a consumer card that
# supports neither ECC nor power readings.
A100 = {
    "name": "NVIDIA A100-SXM4-80GB",
    "uuid": "GPU-5a3f9c0e-2b1d-4c8e-9f7a-1e2d3c4b5a69",
    "util": SimpleNamespace(gpu=87, memory=45),
    "memory": SimpleNamespace(total=85899345920, used=75497472000, free=10401873920),
    "temp": 61,
    "power": 312456,  # mW
    "limit": 400000,
    "ecc": 0,
}
RTX = {
    "name": "NVIDIA GeForce RTX 4090",
    "uuid": "GPU-0f4e6c1a-8d2b-47a3-b5e9-3c2a1d0f9e87",
    "util": SimpleNamespace(gpu=3, memory=1),
    "memory": SimpleNamespace(total=25757220864, used=1104150528, free=24653070336),
    "temp": 38,
    "power": nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED),
    "limit": 450000,
    "ecc": nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED),
}


class FakeNvml:
    """pynvml's functions, answering from recorded readings; a reading that is an NVMLError
    is raised, as the real call would."""

    NVMLError = pynvml.NVMLError
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC

    def __init__(self, devices: list[Any], init_error: Exception | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if isinstance(self.devices[index], Exception):
            raise self.devices[index]
        return index

    def _get(self, handle: int, key: str, *args: Any) -> Any:
        self.calls.append((key, args))
        found = self.devices[handle][key]
        if isinstance(found, Exception):
            raise found
        return found

    def nvmlDeviceGetName(self, handle: int) -> Any:
        return self._get(handle, "name")

    def nvmlDeviceGetUUID(self, handle: int) -> Any:
        return self._get(handle, "uuid")

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return self._get(handle, "util")

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return self._get(handle, "memory")

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> Any:
        return self._get(handle, "temp", sensor)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> Any:
        return self._get(handle, "power")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> Any:
        return self._get(handle, "limit")

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> Any:
        return self._get(handle, "ecc", kind, counter)


def test_nvml_readings_map_to_the_common_shape() -> None:
    fake = FakeNvml([A100, {**A100, "uuid": "GPU-2", "temp": 66, "ecc": 2}, RTX])
    readings = NvmlReader(fake).read()
    assert readings is not None
    assert readings[0] == {
        "index": 0,
        "uuid": "GPU-5a3f9c0e-2b1d-4c8e-9f7a-1e2d3c4b5a69",
        "name": "NVIDIA A100-SXM4-80GB",
        "util": 0.87,
        "mem_used": 75497472000.0,
        "mem_total": 85899345920.0,
        "temp": 61.0,
        "power": pytest.approx(312.456),
        "power_limit": 400.0,
        "ecc_errors": 0,
        "xid": None,  # NVML's XID events are not read: unknown, not "none"
    }
    assert readings[1]["ecc_errors"] == 2 and readings[1]["temp"] == 66
    # A card without ECC or power readings reports them as unknown, never as 0.
    assert readings[2]["ecc_errors"] is None and readings[2]["power"] is None
    assert readings[2]["power_limit"] == 450.0
    assert ("temp", (pynvml.NVML_TEMPERATURE_GPU,)) in fake.calls
    uncorrected = (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
    assert ("ecc", uncorrected) in fake.calls


def test_a_lost_gpu_is_left_out_so_the_count_drops() -> None:
    lost = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    readings = NvmlReader(FakeNvml([A100, lost])).read()
    assert readings is not None and [g["index"] for g in readings] == [0]


@pytest.mark.parametrize(
    "fake",
    [
        FakeNvml([A100], init_error=nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)),
        FakeNvml([A100], init_error=nvml_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)),
        FakeNvml([]),
    ],
    ids=["no-library", "no-driver", "no-device"],
)
def test_without_nvml_the_reader_says_no_gpu_once(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    reader = NvmlReader(fake)
    with caplog.at_level(logging.INFO, logger="controlpanel.fleet.gpu"):
        assert [reader.read() for _ in range(3)] == [None, None, None]
    said = [r.getMessage() for r in caplog.records if "no GPU" in r.getMessage()]
    assert len(said) == 1


def test_this_machine_has_no_nvml_and_the_real_pynvml_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The real situation here: nvidia-ml-py is installed, the NVML library is not."""
    with caplog.at_level(logging.INFO, logger="controlpanel.fleet.gpu"):
        assert NvmlReader().read() is None
    assert "no GPU" in caplog.text


def test_the_agent_sends_a_gpu_block_only_when_nvml_reads() -> None:
    with_gpus = Agent(
        controller="http://c", worker_url="http://w", token="", nvml=NvmlReader(FakeNvml([A100]))
    )
    without = Agent(controller="http://c", worker_url="http://w", token="")
    for agent in (with_gpus, without):
        agent.read_queue_length = lambda: 3  # type: ignore[method-assign]
    assert with_gpus.beat()["gpus"][0]["name"] == "NVIDIA A100-SXM4-80GB"
    assert without.beat() == {"queue_length": 3}


# --- DCGM exporter text ----------------------------------------------------------------------

# What dcgm-exporter serves on a Kubernetes node with two H100s, one of them busy with a vLLM
# pod: its default counters (HELP and TYPE as it writes them), Kubernetes labels, a counter
# without a `_total` suffix, and DCGM's "blank" for a field the GPU does not support.
DCGM_SAMPLE = (DATA / "dcgm-exporter-2xH100.txt").read_text()


def test_dcgm_exporter_text_maps_to_the_common_shape() -> None:
    readings = parse_dcgm(DCGM_SAMPLE)
    assert readings is not None and [g["index"] for g in readings] == [0, 1]
    busy, idle = readings
    assert busy == {
        "index": 0,
        "uuid": "GPU-8c1f2a3b-4d5e-6f70-8192-a3b4c5d6e7f8",
        "name": "NVIDIA H100 80GB HBM3",
        "util": 0.94,
        "mem_used": 74791 * MIB,  # FB values are MiB
        "mem_total": (74791 + 6213) * MIB,
        "temp": 67.0,
        "power": 512.327,
        "power_limit": None,  # not among the default counters: unknown
        "ecc_errors": None,
        "xid": 0,
    }
    assert idle["util"] == 0.0 and idle["mem_used"] == 0  # a real zero stays a zero
    assert idle["xid"] == 48 and idle["ecc_errors"] == 1


def test_dcgm_blank_fields_and_missing_series_are_unknown() -> None:
    text = (
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-x"} 9223372036854775794\n'
        'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-x"} 140737488355328\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-x"} 12\n'
    )
    readings = parse_dcgm(text)
    assert readings is not None
    (only,) = readings
    assert only["temp"] is None and only["power"] is None and only["util"] == 0.12
    assert only["mem_used"] is None and only["mem_total"] is None and only["name"] is None


@pytest.mark.parametrize("text", ["<html>Bad Gateway</html>", "DCGM_FI_DEV_GPU_UTIL{gpu="])
def test_text_that_is_not_prometheus_is_no_reading(text: str) -> None:
    assert parse_dcgm(text) is None


def test_an_exporter_without_gpus_reports_none() -> None:
    assert parse_dcgm("# HELP up whatever\n# TYPE up gauge\nup 1\n") == []


# --- the stored shape ------------------------------------------------------------------------


def test_clean_gpus_bounds_the_shape_and_its_size() -> None:
    raw = [
        {"index": i, "name": "x" * 500, "util": 7, "temp": float("nan"), "power": -3, "foo": 1}
        for i in range(100)
    ]
    raw += [{"index": 3, "name": "duplicate"}, {"index": "0"}, "junk", {"index": -1}]
    cleaned = clean_gpus(raw)
    assert cleaned is not None and len(cleaned) == gpu.MAX_GPUS
    first = cleaned[0]
    assert set(first) == set(gpu.FIELDS)
    assert len(first["name"]) == gpu.MAX_TEXT
    assert first["util"] == 1.0 and first["temp"] is None and first["power"] is None
    assert cleaned[3]["name"] != "duplicate"
    assert clean_gpus({"index": 0}) is None


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("", ""),
        ("http://gpu-1:9400", "http://gpu-1:9400/metrics"),
        ("HTTP://gpu-1:9400/", "http://gpu-1:9400/metrics"),
        ("http://10.0.0.7:9400/metrics", "http://10.0.0.7:9400/metrics"),
        ("http://127.0.0.1:8000/dcgm-metrics", "http://127.0.0.1:8000/dcgm-metrics"),
    ],
)
def test_dcgm_urls(given: str, expected: str) -> None:
    assert normalize_dcgm_url(given) == expected


@pytest.mark.parametrize("bad", ["gpu-1:9400", "ftp://gpu-1/metrics", "http:///metrics"])
def test_bad_dcgm_urls_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="DCGM"):
        normalize_dcgm_url(bad)


# --- warnings and sources ----------------------------------------------------------------------


def worker(**fields: Any) -> Worker:
    return Worker(url="http://w", name="w", source="agent", **fields)


def keys(warnings: list[dict[str, str]]) -> list[str]:
    return [w["key"] for w in warnings]


def test_healthy_gpus_raise_no_warning() -> None:
    assert evaluate([reading(0), reading(1)], count_max=2, active=set(), limits=LIMITS) == []


def test_each_kind_of_trouble_has_its_warning() -> None:
    gpus = [
        reading(0, temp=91.0),
        reading(1, mem_used=79 * GIB),
        reading(2, xid=79),
        reading(3, ecc_errors=2),
    ]
    found = evaluate(gpus, count_max=5, active=set(), limits=LIMITS)
    assert keys(found) == ["temp:GPU-0", "memory:GPU-1", "xid:GPU-2:79", "ecc:GPU-3", "count"]
    messages = [w["message"] for w in found]
    assert messages[0] == "GPU 0 at 91 °C (warning from 85 °C)"
    assert messages[1] == "GPU 1 memory 98.8% full (warning from 98%)"
    assert messages[2] == "GPU 2 XID 79: GPU has fallen off the bus"
    assert "2 uncorrectable ECC" in messages[3]
    assert messages[4] == "4 of 5 GPUs report; one may have fallen off the bus"


def test_a_warning_clears_only_past_the_hysteresis_margin() -> None:
    warm = [reading(0, temp=83.0)]
    assert evaluate(warm, count_max=1, active=set(), limits=LIMITS) == []
    assert keys(evaluate(warm, count_max=1, active={"temp:GPU-0"}, limits=LIMITS)) == ["temp:GPU-0"]
    cool = [reading(0, temp=81.0)]
    assert evaluate(cool, count_max=1, active={"temp:GPU-0"}, limits=LIMITS) == []


def test_events_only_when_a_warning_appears_or_goes() -> None:
    hot = gpu_change(worker(), gpus=[reading(0, temp=90.0)], source=DCGM, now=NOW, limits=LIMITS)
    assert hot.events == [("gpu_warning", "GPU 0 at 90 °C (warning from 85 °C)")]
    still_hot = worker(**hot.fields)
    hotter = gpu_change(
        still_hot, gpus=[reading(0, temp=92.0)], source=DCGM, now=NOW, limits=LIMITS
    )
    assert hotter.events == []
    assert hotter.fields["gpu_warnings"][0]["message"].startswith("GPU 0 at 92 °C")
    cooled = gpu_change(
        worker(**hotter.fields), gpus=[reading(0)], source=DCGM, now=NOW, limits=LIMITS
    )
    assert cooled.events == [("gpu_cleared", "resolved: GPU 0 at 92 °C (warning from 85 °C)")]


def test_fewer_gpus_than_before_warns_until_they_are_back() -> None:
    two = gpu_change(worker(), gpus=[reading(0), reading(1)], source=NVML, now=NOW, limits=LIMITS)
    assert two.fields["gpu_count_max"] == 2 and two.events == []
    one = gpu_change(worker(**two.fields), gpus=[reading(0)], source=NVML, now=NOW, limits=LIMITS)
    assert one.events == [("gpu_warning", "1 of 2 GPUs report; one may have fallen off the bus")]
    back = gpu_change(
        worker(**one.fields), gpus=[reading(0), reading(1)], source=NVML, now=NOW, limits=LIMITS
    )
    assert [kind for kind, _ in back.events] == ["gpu_cleared"]


def test_the_dcgm_exporter_wins_over_nvml_while_it_is_fresh() -> None:
    dcgm_fed = worker(
        dcgm_url="http://exporter/metrics",
        gpus=[reading(0)],
        gpus_source=DCGM,
        gpus_at=NOW,
        gpu_count_max=1,
    )
    ignored = gpu_change(dcgm_fed, gpus=[reading(0, util=0.1)], source=NVML, now=NOW)
    assert ignored.fields == {} and ignored.events == []
    later = NOW + timedelta(seconds=gpu_health.stale_after() + 1)
    taken = gpu_change(dcgm_fed, gpus=[reading(0, util=0.1)], source=NVML, now=later)
    assert taken.fields["gpus_source"] == NVML
    # Without an exporter the agent's NVML readings are simply the readings.
    plain = gpu_change(worker(), gpus=[reading(0)], source=NVML, now=NOW)
    assert plain.fields["gpus_source"] == NVML


def test_a_switch_of_source_does_not_count_missing_gpus() -> None:
    # The node's exporter saw 8 GPUs; the container's NVML sees the worker's 2.
    node = worker(gpus=[reading(i) for i in range(8)], gpus_source=DCGM, gpu_count_max=8)
    node.gpus_at = NOW - timedelta(hours=1)
    switched = gpu_change(node, gpus=[reading(0), reading(1)], source=NVML, now=NOW)
    assert switched.fields["gpu_count_max"] == 2 and switched.events == []


def test_stale_readings_are_unknown() -> None:
    fed = worker(gpus=[reading(0)], gpus_source=NVML, gpus_at=NOW)
    assert gpu_health.fresh_gpus(fed, NOW) == [reading(0)]
    later = NOW + timedelta(seconds=gpu_health.stale_after() + 1)
    assert gpu_health.fresh_gpus(fed, later) is None
    assert gpu_strip(fed, later) is None
    assert gpu_health.fresh_gpus(worker(), NOW) is None


def test_the_strip_cell_says_what_the_bars_do_not() -> None:
    fed = worker(
        gpus=[reading(0, temp=64.0), reading(1, power=None)],
        gpus_source=DCGM,
        gpus_at=NOW,
        gpu_warnings=[{"key": "temp:GPU-1", "message": "hot"}],
    )
    strip = gpu_strip(fed, NOW)
    assert strip is not None
    assert strip[0].util == 50 and strip[0].mem == pytest.approx(87.5)
    assert strip[0].title == (
        "GPU 0 · NVIDIA H100 80GB HBM3\nutilisation 50%\nmemory 70.0 / 80.0 GiB\n"
        "temperature 64 °C\npower 300 W of 700 W"
    )
    assert "power unknown" in strip[1].title
    assert [c.warned for c in strip] == [False, True]


def test_chart_points_keep_unknown_out() -> None:
    assert fixed_scale_points([None, 50.0, None, 100.0], width=30, height=12) == (
        "10.0,6.0 30.0,1.0"
    )
    assert fixed_scale_points([None, 120.0]) == ""  # one point draws nothing


# --- the simulator's exporter ------------------------------------------------------------------


def test_simulated_gpus_are_plausible_and_change() -> None:
    gpus = SimulatedGpus(2)
    idle = parse_dcgm(gpus.render(load=0.0, kv_usage=0.0, now=1000.0))
    assert idle is not None and len(idle) == 2
    for g in idle:
        assert g["util"] is not None and g["util"] < 0.15
        assert g["temp"] is not None and 25 < g["temp"] < 50
        assert g["mem_total"] == 81559 * MIB
        assert 0.85 < g["mem_used"] / g["mem_total"] < 0.95  # vLLM reserves it up front
    for step in range(6):
        busy = parse_dcgm(gpus.render(load=1.0, kv_usage=0.8, now=1005.0 + step * 5))
    assert busy is not None
    assert busy[0]["util"] > 0.8 and busy[0]["temp"] > idle[0]["temp"] + 20
    assert busy[0]["power"] > idle[0]["power"] * 3
    assert busy[0]["uuid"] != busy[1]["uuid"]


def test_simulated_gpu_faults() -> None:
    gpus = SimulatedGpus(2)
    gpus.control({"gpu_count": 1, "gpu_temp": 93, "gpu_xid": 79})
    readings = parse_dcgm(gpus.render(load=0.5, kv_usage=0.5, now=0.0))
    assert readings is not None and len(readings) == 1
    assert readings[0]["temp"] == 93 and readings[0]["xid"] == 79
    gpus.control({"gpu_count": 2, "gpu_temp": None, "gpu_xid": 0})
    readings = parse_dcgm(gpus.render(load=0.5, kv_usage=0.5, now=0.0))
    assert readings is not None and len(readings) == 2 and readings[0]["temp"] < 90


# --- /metrics ----------------------------------------------------------------------------------


def view(worker_id: int, name: str, gpus: tuple[GpuView, ...]) -> WorkerView:
    return WorkerView(
        id=worker_id,
        name=name,
        url=f"http://{name}",
        state="active",
        source="operator",
        models=(ModelEntry(id="m"),),
        queue_length=None,
        last_heartbeat=None,
        routable=True,
        gpus=gpus,
    )


def test_gpu_families_are_labelled_worker_and_gpu() -> None:
    app = RouterApp()
    h100 = GpuView(
        index=0, uuid="GPU-a", name="NVIDIA H100 80GB HBM3", util=0.73, mem_used=60 * GIB,
        mem_total=80 * GIB, temp=64.0, power=312.5, power_limit=700.0, ecc_errors=0, xid=0,
    )  # fmt: skip
    partial = GpuView(index=1, uuid="GPU-b", util=0.1, temp=None)
    app.install(
        build_snapshot(
            workers=(view(1, "gpu-a", (h100, partial)), view(2, "cpu-only", ())),
            served_models=(),
            generation=1,
        )
    )
    samples = parse(app.render_metrics().decode())
    w, g = "gpu-a", "0"
    assert value(samples, "controlpanel_gpu_utilization", worker=w, gpu=g) == 0.73
    assert value(samples, "controlpanel_gpu_memory_used_bytes", worker=w, gpu=g) == 60 * GIB
    assert value(samples, "controlpanel_gpu_memory_total_bytes", worker=w, gpu=g) == 80 * GIB
    assert value(samples, "controlpanel_gpu_temperature_celsius", worker=w, gpu=g) == 64
    assert value(samples, "controlpanel_gpu_power_watts", worker=w, gpu=g) == 312.5
    assert value(samples, "controlpanel_gpu_power_limit_watts", worker=w, gpu=g) == 700
    assert value(samples, "controlpanel_gpu_ecc_uncorrected_errors", worker=w, gpu=g) == 0
    assert value(samples, "controlpanel_gpu_last_xid", worker=w, gpu=g) == 0
    info = {"worker": w, "gpu": g, "uuid": "GPU-a", "name": "NVIDIA H100 80GB HBM3"}
    assert samples[("controlpanel_gpu_info", frozenset(info.items()))] == 1
    # Unknown is no sample, never a zero; a worker without GPUs has no GPU series at all.
    assert value(samples, "controlpanel_gpu_temperature_celsius", worker=w, gpu="1") is None
    assert value(samples, "controlpanel_gpu_utilization", worker=w, gpu="1") == 0.1
    assert not [n for n, labels in samples if ("worker", "cpu-only") in labels and "_gpu_" in n]

    app.exports_fleet_metrics = False
    left = parse(app.render_metrics().decode())
    assert not [name for name, _ in left if name.startswith("controlpanel_gpu_")]
