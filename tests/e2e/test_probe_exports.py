"""Celery health probes against servers that export what the simulator does not: no
metrics, the old metric names, a sleeping engine, a LoRA adapter loaded between two model
refreshes. A fake vLLM server whose answers the test sets at will.

The task function runs in this process (as Celery's eager mode would) on the shared test
database; healthy, failing and hanging workers are in tests/e2e/test_probes.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from django.utils import timezone
from pytest_django.fixtures import Settings as SettingsWrapper

from controlpanel.fleet import probes, services
from controlpanel.fleet.tasks import probe_workers
from controlpanel.registry.models import RoutingGeneration, ServedModel, WorkerSample
from controlpanel.routers import snapshot as selectors
from tests.support.probes import events, fresh
from tests.support.recorded_metrics import OLD_MODEL, RECORDED_OLD, advance, key, sleep_lines
from tests.support.servers import (
    SimulatorLoop,
    StartSimulator,
)

# The probes' own timeouts and thresholds (tests/e2e/conftest.py).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("probe_settings")]


# --- a fake vLLM server ------------------------------------------------------------------


class FakeVllm:
    """A server whose /health status, /metrics text and model list a test sets at will,
    for what the simulator does not do (no metrics, old names, a sleeping engine)."""

    def __init__(self, model: str = "fake-model") -> None:
        self.health_status = 200
        self.metrics_status = 200
        self.metrics_text = ""
        self.models_payload: dict[str, Any] = {
            "object": "list",
            "data": [{"id": model, "object": "model", "root": model, "parent": None}],
        }
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> FakeVllm:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(status=self.metrics_status, text=self.metrics_text)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(self.models_payload)


@pytest.fixture
def fake_vllm(sim_loop: SimulatorLoop) -> Iterator[Callable[..., FakeVllm]]:
    started: list[FakeVllm] = []

    def start(model: str = "fake-model") -> FakeVllm:
        fake: FakeVllm = sim_loop.run(FakeVllm(model).start())
        started.append(fake)
        return fake

    yield start
    for fake in started:
        sim_loop.run(fake.stop())


# --- what servers export -----------------------------------------------------------------


def test_missing_metrics_stay_none(fake_vllm: Callable[..., FakeVllm]) -> None:
    empty = fake_vllm("empty")
    absent = fake_vllm("absent")
    absent.metrics_status = 404
    workers = [services.worker_add(url=f.url, actor="test") for f in (empty, absent)]
    for _ in range(2):
        probe_workers()
    for worker in workers:
        probed = fresh(worker)
        assert probed.state == "active" and probed.consecutive_successes == 2
        assert probed.metrics == dict.fromkeys(probes.METRIC_KEYS)
        assert probed.queue_length is None and probed.sleeping is None
        samples = list(WorkerSample.objects.filter(worker=worker))
        assert [(s.up, s.running, s.kv_cache_usage, s.rps) for s in samples] == [
            (True, None, None, None)
        ] * 2


def test_old_metric_names_are_read(fake_vllm: Callable[..., FakeVllm]) -> None:
    fake = fake_vllm(OLD_MODEL)
    fake.metrics_text = RECORDED_OLD
    worker = services.worker_add(url=fake.url, actor="test")
    probe_workers()
    fake.metrics_text = advance(
        RECORDED_OLD,
        {
            key("vllm:gpu_prefix_cache_queries_total", model_name=OLD_MODEL): 40,
            key("vllm:gpu_prefix_cache_hits_total", model_name=OLD_MODEL): 30,
        },
    )
    probe_workers()
    probed = fresh(worker)
    assert probed.metrics["kv_cache_usage"] == pytest.approx(0.62)
    assert probed.metrics["prefix_hit_rate"] == pytest.approx(0.75)
    assert probed.queue_length == 7


def test_a_sleeping_engine_leaves_the_rotation_and_comes_back(
    fake_vllm: Callable[..., FakeVllm],
) -> None:
    fake = fake_vllm("m")
    fake.metrics_text = sleep_lines(1, 0, 0)
    worker = services.worker_add(url=fake.url, actor="test")
    probe_workers()
    assert fresh(worker).sleeping is False
    assert not events("worker_awake", worker)  # nothing changed: it was never asleep

    fake.metrics_text = sleep_lines(0, 1, 0)
    before = RoutingGeneration.current()
    probe_workers()
    probed = fresh(worker)
    assert probed.sleeping is True and probed.state == "active"
    assert len(events("worker_sleeping", worker)) == 1
    assert RoutingGeneration.current() >= before + 2
    assert not selectors.worker_view(probed, now=timezone.now()).routable

    fake.metrics_text = ""  # the metric disappears: a sleeper must not slip back in
    probe_workers()
    assert fresh(worker).sleeping is True

    fake.metrics_text = sleep_lines(1, 0, 0)
    probe_workers()
    probed = fresh(worker)
    assert probed.sleeping is False
    assert len(events("worker_awake", worker)) == 1
    assert selectors.worker_view(probed, now=timezone.now()).routable


def test_models_refresh_picks_up_a_new_lora(
    simulator: StartSimulator, probe_settings: SettingsWrapper
) -> None:
    probe_settings.CONTROLPANEL_MODELS_EVERY = 2
    sim = simulator("base")
    worker = services.worker_add(url=sim.url, actor="test")
    asked = sim.state.by_path["/v1/models"]  # the discovery when it was added

    probe_workers()  # reads /v1/models: unchanged, so no event
    assert not events("models_changed", worker)
    load = {"lora_name": "sql-lora", "lora_path": "/adapters/sql"}
    httpx.post(f"{sim.url}/v1/load_lora_adapter", json=load).raise_for_status()
    probe_workers()  # not due this time
    assert fresh(worker).model_ids == ["base"]

    before = RoutingGeneration.current()
    probe_workers()
    probed = fresh(worker)
    assert probed.model_ids == ["base", "sql-lora"]
    assert probed.models[1]["parent"] == "base"
    assert sim.state.by_path["/v1/models"] == asked + 2
    (event,) = events("models_changed", worker)
    assert event.message == "models now base, sql-lora; added sql-lora"
    assert ServedModel.objects.filter(name="sql-lora").exists()
    assert RoutingGeneration.current() >= before + 2
