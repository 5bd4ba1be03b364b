"""GPU telemetry end to end: the agent's heartbeat API, the probe scraping a simulated DCGM
exporter, warnings and events, the router's /metrics, the pages, and the real agent
command on this machine, which has no NVML."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlpanel.fleet import services
from controlpanel.fleet.tasks import probe_workers
from controlpanel.registry.models import Event, Worker, WorkerSample
from simulator.server import RunningSimulator
from tests.support.common import ADMIN_HEADERS, AGENT_HEADERS, ROOT
from tests.support.gpu import reading
from tests.support.login import logged_in
from tests.support.metrics import scrape_until, value
from tests.support.servers import (
    RouterServer,
    StartSimulator,
    free_port,
    subprocess_env,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)

UTIL = "controlpanel_gpu_utilization"


def fresh(worker: Worker) -> Worker:
    return Worker.objects.get(pk=worker.pk)


def gpu_events(worker: Worker) -> list[tuple[str, str]]:
    found = Event.objects.filter(worker=worker, kind__startswith="gpu_").order_by("id")
    return [(e.kind, e.message) for e in found]


def exporter(sim: RunningSimulator) -> str:
    return f"{sim.url}/dcgm-metrics"


def control(sim: RunningSimulator, **changes: Any) -> None:
    httpx.post(f"{sim.url}/sim/control", json=changes, timeout=5).raise_for_status()


def patch(router: RouterServer, worker_id: int, body: dict[str, Any], expect: int = 200) -> Any:
    response = httpx.patch(
        f"{router.url}/api/workers/{worker_id}", json=body, headers=ADMIN_HEADERS, timeout=10
    )
    assert response.status_code == expect, response.text
    return response.json()


# --- the agent's heartbeat --------------------------------------------------------------------


def register(router: RouterServer, url: str, **extra: Any) -> int:
    body = {"url": url, "models": ["m"], **extra}
    response = router.post("/api/workers/register", json=body, headers=AGENT_HEADERS)
    assert response.status_code == 200, response.text
    return int(response.json()["id"])


def beat(router: RouterServer, worker_id: int, **body: Any) -> httpx.Response:
    return router.post(f"/api/workers/{worker_id}/heartbeat", json=body, headers=AGENT_HEADERS)


def test_heartbeats_carry_nvml_readings_and_a_lost_gpu_warns(router: RouterServer) -> None:
    worker_id = register(router, "http://gpu-host-1:8000")
    assert beat(router, worker_id, queue_length=1, gpus=[reading(0), reading(1)]).status_code == 200
    worker = Worker.objects.get(pk=worker_id)
    assert worker.gpus_source == "nvml" and [g["index"] for g in worker.gpus] == [0, 1]
    assert worker.gpus[0]["mem_total"] == 80 * 1024**3 and worker.gpu_warnings == []

    assert beat(router, worker_id, gpus=[reading(0)]).status_code == 200
    assert gpu_events(worker) == [
        ("gpu_warning", "1 of 2 GPUs report; one may have fallen off the bus")
    ]
    shown = router.get(f"/api/workers/{worker_id}", headers=ADMIN_HEADERS).json()
    assert shown["gpus_source"] == "nvml" and len(shown["gpus"]) == 1
    assert shown["gpu_warnings"] == ["1 of 2 GPUs report; one may have fallen off the bus"]

    # The operator removed a GPU on purpose: accepting the count ends the warning.
    patched = patch(router, worker_id, {"reset_gpu_count": True})
    assert patched["gpu_warnings"] == []
    assert beat(router, worker_id, gpus=[reading(0)]).status_code == 200
    assert fresh(worker).gpu_warnings == []


def test_a_heartbeat_without_gpus_leaves_them_unknown(router: RouterServer) -> None:
    worker_id = register(router, "http://cpu-host:8000")
    assert beat(router, worker_id, queue_length=0).status_code == 200
    worker = Worker.objects.get(pk=worker_id)
    assert worker.gpus == [] and worker.gpus_source == "" and worker.gpus_at is None


@pytest.mark.parametrize(
    "gpus",
    [
        [reading(i) for i in range(33)],  # more GPUs than any node has
        [reading(0, util=1.5)],  # utilisation is a fraction
        [{"index": 0, "name": "x" * 500}],
        [{"util": 0.5}],  # no index
    ],
    ids=["too-many", "util-over-1", "long-name", "no-index"],
)
def test_malformed_gpu_blocks_are_refused(router: RouterServer, gpus: list[Any]) -> None:
    worker_id = register(router, "http://gpu-host-2:8000")
    response = beat(router, worker_id, gpus=gpus)
    assert response.status_code == 422, response.text
    assert Worker.objects.get(pk=worker_id).gpus == []


# --- the probe and a DCGM exporter ----------------------------------------------------------


def test_the_probe_reads_the_exporter_and_warns_on_trouble(simulator: StartSimulator) -> None:
    sim = simulator("m", gpus=2)
    worker = services.worker_add(url=sim.url, dcgm_url=exporter(sim), actor="test")

    probe_workers()
    probed = fresh(worker)
    assert probed.gpus_source == "dcgm" and [g["index"] for g in probed.gpus] == [0, 1]
    first = probed.gpus[0]
    assert first["name"] == "NVIDIA H100 80GB HBM3" and first["uuid"].startswith("GPU-")
    assert 0 <= first["util"] <= 1 and first["mem_total"] == 81559 * 1024**2
    assert gpu_events(worker) == []

    control(sim, gpu_temp=95, gpu_count=1, gpu_xid=79)
    probe_workers()
    assert [kind for kind, _ in gpu_events(worker)] == ["gpu_warning"] * 3
    messages = [w["message"] for w in fresh(worker).gpu_warnings]
    assert messages == [
        "GPU 0 at 95 °C (warning from 85 °C)",
        "GPU 0 XID 79: GPU has fallen off the bus",
        "1 of 2 GPUs report; one may have fallen off the bus",
    ]
    probe_workers()  # still in trouble: no new event
    assert len(gpu_events(worker)) == 3

    control(sim, gpu_temp=None, gpu_count=2, gpu_xid=0)
    probe_workers()
    assert [kind for kind, _ in gpu_events(worker)][3:] == ["gpu_cleared"] * 3
    assert fresh(worker).gpu_warnings == []

    samples = list(WorkerSample.objects.filter(worker=worker).values_list("gpus", flat=True))
    assert [len(s or []) for s in samples] == [2, 1, 1, 2]
    assert set(samples[0][0]) == {"index", "util", "mem", "temp", "power"}


def test_a_failing_exporter_changes_nothing(simulator: StartSimulator) -> None:
    sim = simulator("m")
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    worker = services.worker_add(url=sim.url, dcgm_url=dead, actor="test")
    probe_workers()
    probed = fresh(worker)
    assert probed.state == "active" and probed.gpus == [] and probed.gpus_source == ""


def test_the_exporter_wins_over_the_agents_nvml(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("m", gpus=2)
    worker_id = register(router, sim.url, dcgm_url=exporter(sim))
    assert Worker.objects.get(pk=worker_id).dcgm_url == exporter(sim)
    probe_workers()
    beat(router, worker_id, gpus=[reading(0, name="container view")])
    worker = Worker.objects.get(pk=worker_id)
    assert worker.gpus_source == "dcgm" and len(worker.gpus) == 2


def test_the_router_exports_the_gpus(
    router: RouterServer, simulator: StartSimulator, add_worker: Any
) -> None:
    sim = simulator("m", gpus=2)
    worker = add_worker(sim, name="gpu-metrics")
    services.worker_update(
        worker_id=worker.pk, name=None, weight=None, dcgm_url=exporter(sim), actor="test"
    )
    probe_workers()  # bumps the generation: the router rebuilds its snapshot
    samples = scrape_until(
        router, lambda s: value(s, UTIL, worker="gpu-metrics", gpu="1") is not None
    )
    stored = fresh(worker).gpus
    for index in ("0", "1"):
        gpu = stored[int(index)]
        labels = {"worker": "gpu-metrics", "gpu": index}
        assert value(samples, UTIL, **labels) == pytest.approx(gpu["util"])
        assert value(samples, "controlpanel_gpu_memory_used_bytes", **labels) == gpu["mem_used"]
        assert value(samples, "controlpanel_gpu_memory_total_bytes", **labels) == gpu["mem_total"]
        assert value(samples, "controlpanel_gpu_temperature_celsius", **labels) == gpu["temp"]
        assert value(samples, "controlpanel_gpu_power_watts", **labels) == gpu["power"]


# --- the admin API and the pages ------------------------------------------------------------


def test_operators_set_and_clear_the_exporter(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("m")
    added = router.post(
        "/api/workers",
        json={"url": sim.url, "dcgm_url": "http://node-7:9400"},
        headers=ADMIN_HEADERS,
    )
    assert added.status_code == 201, added.text
    assert added.json()["dcgm_url"] == "http://node-7:9400/metrics"
    worker_id = added.json()["id"]
    assert patch(router, worker_id, {"dcgm_url": ""})["dcgm_url"] == ""
    refused = patch(router, worker_id, {"dcgm_url": "node-7:9400"}, expect=422)
    assert "DCGM" in refused["error"]["message"]


def test_the_pages_show_strips_unknown_and_charts(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator("m", gpus=2)
    with_gpus = services.worker_add(
        url=sim.url, name="gpu-strip", dcgm_url=exporter(sim), actor="t"
    )
    without = services.worker_add(url=simulator("n").url, name="no-gpu", actor="test")
    probe_workers()
    time.sleep(0.01)  # two readings at two distinct instants: the charts need a line
    probe_workers()
    session = logged_in(router)
    page = session.get("/").text
    strip = _cell(page, with_gpus.pk)
    assert strip.count('class="gpu"') == 2 and "temperature" in strip and "GiB" in strip
    assert ">unknown<" in _cell(page, without.pk)

    worker_page = session.get(f"/workers/{with_gpus.pk}/").text
    assert worker_page.count('data-testid="gpu-chart"') == 2
    assert '<polyline class="util"' in worker_page and '<polyline class="temp"' in worker_page
    assert "Read from the DCGM exporter" in worker_page
    assert "No GPU readings" in session.get(f"/workers/{without.pk}/").text


def _cell(page: str, worker_id: int) -> str:
    row = page.split(f'id="worker-{worker_id}"', 1)[1].split("</tr>", 1)[0]
    return row.split('data-testid="gpus">', 1)[1].split("</td>", 1)[0]


def test_the_add_form_takes_an_exporter(router: RouterServer, simulator: StartSimulator) -> None:
    sim = simulator("m")
    session = logged_in(router)
    session.get("/")
    token = session.cookies["csrftoken"]
    form = {"url": sim.url, "dcgm_url": exporter(sim), "csrfmiddlewaretoken": token}
    response = session.post("/workers/add", data=form, headers={"Referer": f"{router.url}/"})
    assert response.status_code == 302
    assert Worker.objects.get(url=sim.url).dcgm_url == exporter(sim)


# --- the real agent, without NVML ---------------------------------------------------------------


def test_the_agent_without_nvml_says_no_gpu_once_and_keeps_beating(
    router: RouterServer, simulator: StartSimulator, tmp_path: Path
) -> None:
    sim = simulator("m", gpus=1)
    command = [
        sys.executable, "manage.py", "worker_agent", "--controller", router.url,
        "--worker-url", sim.url, "--interval", "0.2", "--name", "no-nvml",
        "--dcgm-url", exporter(sim),
    ]  # fmt: skip
    log_path = tmp_path / "agent.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=subprocess_env(tmp_path), stdout=log, stderr=subprocess.STDOUT
        )
    try:
        worker = wait_until(lambda: Worker.objects.filter(name="no-nvml").first())
        beat = wait_until(lambda: fresh(worker).last_heartbeat)
        for _ in range(4):  # a few more heartbeats, each of which could have said it again
            beat = wait_until(lambda b=beat: (t := fresh(worker).last_heartbeat) > b and t)
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    output = log_path.read_text()
    assert output.count("no GPU") == 1, output
    assert "Traceback" not in output
    beaten = fresh(worker)
    assert beaten.dcgm_url == exporter(sim)
    assert beaten.gpus == [] and beaten.gpus_source == ""  # no GPU block, no zeros
