"""The fleet's GPUs on /metrics (routing.telemetry.gpu_metrics): one series per worker and
GPU, and never a made-up zero for what the source does not report."""

from __future__ import annotations

from bench.common.workers import worker_view
from routing.fleet.snapshot import GpuView
from routing.telemetry.gpu_metrics import gpu_families
from tests.support.metrics import families_page, names, value


def test_each_gpu_reading_is_a_series_and_an_unreported_one_is_absent() -> None:
    full = GpuView(0, uuid="GPU-1", name="H100", util=0.5, mem_used=1e9, mem_total=8e10,
                   temp=61.0, power=300.0, power_limit=700.0, ecc_errors=0, xid=0)  # fmt: skip
    partial = GpuView(1, util=0.25)  # NVML without the rest
    workers = [worker_view(1, gpus=(full, partial)), worker_view(2)]  # w2: no GPU readings
    page = families_page(gpu_families(workers, lambda worker_id: f"w{worker_id}"))
    info = {
        dict(labels)["gpu"]: dict(labels)
        for name, labels in page
        if name == "controlpanel_gpu_info"
    }
    assert info == {
        "0": {"worker": "w1", "gpu": "0", "uuid": "GPU-1", "name": "H100"},
        "1": {"worker": "w1", "gpu": "1", "uuid": "", "name": ""},
    }
    assert value(page, "controlpanel_gpu_utilization", worker="w1", gpu="1") == 0.25
    assert value(page, "controlpanel_gpu_power_limit_watts", worker="w1", gpu="0") == 700
    assert value(page, "controlpanel_gpu_last_xid", worker="w1", gpu="0") == 0  # reported
    assert value(page, "controlpanel_gpu_temperature_celsius", worker="w1", gpu="1") is None
    assert not any(dict(labels).get("worker") == "w2" for _, labels in page)
    assert "controlpanel_gpu_memory_total_bytes" in names(page)
