"""The worker agent (controlpanel.fleet.agent) against a real HTTP server in this process
that plays both the controller's API and the vLLM server's /metrics: what it registers,
what a heartbeat carries, registering again when forgotten, and the drain on stop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from controlpanel.fleet.agent import Agent, queue_length_from_metrics
from controlpanel.fleet.gpu import GpuReading, NvmlReader
from tests.support.gpu import reading
from tests.support.http_peer import HttpPeer, http_peer
from tests.support.recorded_metrics import RECORDED_NEW, RECORDED_OLD
from tests.support.servers import free_port


class Gpus(NvmlReader):
    """NVML's readings as this test sets them (None: no NVML here)."""

    def __init__(self, gpus: list[GpuReading] | None) -> None:
        super().__init__()
        self.gpus = gpus

    def read(self) -> list[GpuReading] | None:
        return self.gpus


@pytest.fixture
def peer() -> Iterator[HttpPeer]:
    with http_peer() as server:
        server.answer("/api/workers/register", {"id": 7, "heartbeat_interval": 30})
        server.answer("/api/workers/7/heartbeat", {"ok": True})
        server.answer("/api/workers/7/deregister", {"ok": True})
        server.answer("/metrics", RECORDED_NEW)
        yield server


def agent(peer: HttpPeer, gpus: list[GpuReading] | None = None, **options: Any) -> Agent:
    return Agent(
        controller=f"{peer.url}/", worker_url=f"{peer.url}/", token="t" * 32, nvml=Gpus(gpus),
        **options,
    )  # fmt: skip


def test_the_queue_is_running_plus_waiting_or_unknown() -> None:
    assert queue_length_from_metrics(RECORDED_NEW) == 6
    assert queue_length_from_metrics(RECORDED_OLD) == 7
    assert queue_length_from_metrics("# nothing\nother_metric 1\n") is None


def test_registration_sends_only_what_was_given(peer: HttpPeer) -> None:
    plain = agent(peer, name="w")
    plain.step()
    assert (plain.worker_id, plain.interval) == (7, 30.0)
    assert peer.posted[-1] == ("/api/workers/register", {"url": peer.url, "name": "w"})
    assert dict(peer.seen[-1][1])["Authorization"] == "Bearer " + "t" * 32
    full = agent(
        peer, role="prefill", dcgm_url="http://h:9400", vllm_api_key="sk", kv_events="",
        interval=2.0,
    )  # fmt: skip
    full.register()
    assert peer.posted[-1][1] == {
        "url": peer.url, "name": "", "role": "prefill", "dcgm_url": "http://h:9400",
        "api_key": "sk", "kv_events": "", "kv_events_replay": "",
    }  # fmt: skip
    assert full.interval == 2.0  # given: the controller's suggestion does not override it


def test_a_heartbeat_carries_the_queue_and_gpus_only_when_nvml_reads(peer: HttpPeer) -> None:
    with_gpus = agent(peer, gpus=[reading(0)])
    with_gpus.step()
    with_gpus.step()
    assert peer.posted[-1] == ("/api/workers/7/heartbeat", {"queue_length": 6,
                                                            "gpus": [reading(0)]})  # fmt: skip
    metrics_headers = [h for p, h in peer.seen if p == "/metrics"][-1]
    assert "Bearer" not in metrics_headers.get("Authorization", "")  # not the controller's token
    peer.answer("/metrics", "down", status=503)
    without = agent(peer)
    without.worker_id = 7
    without.heartbeat()
    assert peer.posted[-1] == ("/api/workers/7/heartbeat", {"queue_length": None})


def test_a_forgotten_worker_registers_again(peer: HttpPeer) -> None:
    forgotten = agent(peer)
    forgotten.worker_id = 3  # the controller has no worker 3
    forgotten.heartbeat()
    assert forgotten.worker_id == 7
    assert [p for p, _ in peer.posted] == ["/api/workers/3/heartbeat", "/api/workers/register"]


def test_a_stopped_agent_drains_its_worker_once_registered(peer: HttpPeer) -> None:
    never = agent(peer)
    never.deregister()
    assert peer.posted == []
    stopping = agent(peer)
    stopping.stopping.set()
    stopping.worker_id = 7
    stopping.run()  # stopped before its first step: straight to the drain
    assert peer.posted == [("/api/workers/7/deregister", None)]


def test_an_unreachable_controller_is_survived_on_drain() -> None:
    gone = Agent(controller=f"http://127.0.0.1:{free_port()}", worker_url="http://w", token="")
    gone.worker_id = 1
    gone.deregister()  # logs, does not raise
    assert "Authorization" not in gone.http.headers
