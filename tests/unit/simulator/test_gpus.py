"""simulator.gpus: readings that follow the engine's load, the DCGM exporter's text, and the
/sim/control hooks (a GPU off the bus, a pinned temperature, an XID error)."""

from __future__ import annotations

from simulator.gpus import SERIES, TOTAL_MIB, SimulatedGpus


def settled(gpus: SimulatedGpus, load: float) -> list[dict[str, float]]:
    """The readings once the smoothing has converged on `load`."""
    readings = []
    for _ in range(30):
        readings = gpus.readings(load=load, kv_usage=0.0, now=0.0)
    return readings


def test_a_busy_gpu_is_hotter_hungrier_and_more_utilised_than_an_idle_one() -> None:
    idle, busy = settled(SimulatedGpus(1), 0.0)[0], settled(SimulatedGpus(1), 1.0)[0]
    assert idle["DCGM_FI_DEV_GPU_UTIL"] < 10 < 80 < busy["DCGM_FI_DEV_GPU_UTIL"]
    assert idle["DCGM_FI_DEV_GPU_TEMP"] < busy["DCGM_FI_DEV_GPU_TEMP"]
    assert idle["DCGM_FI_DEV_POWER_USAGE"] < busy["DCGM_FI_DEV_POWER_USAGE"] <= 700
    assert busy["DCGM_FI_DEV_SM_CLOCK"] == 1980  # (idle: 345 or, with the noise, 1980)
    for r in (idle, busy):
        assert r["DCGM_FI_DEV_FB_FREE"] + r["DCGM_FI_DEV_FB_USED"] == TOTAL_MIB


def test_memory_grows_with_the_kv_cache() -> None:
    gpus = SimulatedGpus(1)
    empty = gpus.readings(load=0.0, kv_usage=0.0, now=0.0)[0]["DCGM_FI_DEV_FB_USED"]
    full = gpus.readings(load=0.0, kv_usage=1.0, now=0.0)[0]["DCGM_FI_DEV_FB_USED"]
    assert 0.86 * TOTAL_MIB < empty < full < 0.95 * TOTAL_MIB


def test_the_exporter_text_has_every_series_once_per_gpu_with_its_labels() -> None:
    text = SimulatedGpus(2, hostname="node-1").render(load=0.5, kv_usage=0.5, now=0.0)
    lines = text.splitlines()
    for name, help_text in SERIES:
        assert f"# HELP {name} {help_text}" in lines and f"# TYPE {name} gauge" in lines
        samples = [line for line in lines if line.startswith(name + "{")]
        assert len(samples) == 2
        assert 'gpu="1"' in samples[1] and 'pci_bus_id="00000000:19:00.0"' in samples[1]
        assert 'Hostname="node-1"' in samples[0]


def test_control_hides_gpus_pins_the_temperature_and_reports_an_xid() -> None:
    gpus = SimulatedGpus(4)
    gpus.control({"gpu_count": 9, "gpu_temp": 91, "gpu_xid": 79})
    readings = gpus.readings(load=0.0, kv_usage=0.0, now=0.0)
    assert len(readings) == 4  # no more than it has
    assert {r["DCGM_FI_DEV_GPU_TEMP"] for r in readings} == {91}
    assert {r["DCGM_FI_DEV_XID_ERRORS"] for r in readings} == {79}
    gpus.control({"gpu_count": 1, "gpu_temp": None, "gpu_xid": 0, "healthy": False})
    [reading] = gpus.readings(load=0.0, kv_usage=0.0, now=0.0)
    assert reading["DCGM_FI_DEV_GPU_TEMP"] < 91 and reading["DCGM_FI_DEV_XID_ERRORS"] == 0
    gpus.control({"gpu_count": "2", "gpu_xid": "x"})  # not ints: ignored
    assert gpus.count == 1 and gpus.xid == 0
