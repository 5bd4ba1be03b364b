"""Celery health probes against simulated and hanging vLLM servers: healthy workers, failing,
hanging and recovering ones, and what the routers report between probes.

The task function runs in this process (as Celery's eager mode would) on the shared test
database. What servers export (missing metrics, old names, a sleeping engine, new adapters)
is in tests/e2e/test_probe_exports.py; the parsing on recorded vLLM /metrics texts is in
tests/unit/controlpanel/fleet/test_probes.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from unittest.mock import ANY

import httpx
import pytest
from django.utils import timezone
from pytest_django.fixtures import Settings as SettingsWrapper

from controlpanel.fleet import health, probes, services
from controlpanel.fleet.tasks import probe_workers
from controlpanel.registry.models import RoutingGeneration, Worker, WorkerSample
from controlpanel.routers import snapshot as selectors
from tests.support.probes import bare_worker, complete, events, fresh
from tests.support.servers import (
    AddWorker,
    RouterServer,
    SimulatorLoop,
    StartSimulator,
    free_port,
    wait_until,
)

# The probes' own timeouts and thresholds (tests/e2e/conftest.py).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("probe_settings")]


# --- hanging servers -------------------------------------------------------------------


@dataclass
class Held:
    """Connections held open by hanging servers: now, the most at once, and in all."""

    now: int = 0
    peak: int = 0
    total: int = 0


class HangingServer:
    """Accepts connections, reads the requests and never answers (vLLM stuck in a
    CUDA call looks like this), until the client gives up. `held` counts the connections
    it holds open (shared by the servers of a test)."""

    def __init__(self, held: Held) -> None:
        self.url = ""
        self.held = held
        self._server: asyncio.Server | None = None

    async def start(self) -> HangingServer:
        self._server = await asyncio.start_server(self._swallow, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _swallow(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.held.now += 1
        self.held.total += 1
        self.held.peak = max(self.held.peak, self.held.now)
        try:
            while await reader.read(65536):
                pass
        finally:
            self.held.now -= 1
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.fixture
def hanging_server(sim_loop: SimulatorLoop) -> Iterator[Callable[[], HangingServer]]:
    started: list[HangingServer] = []
    held = Held()

    def start() -> HangingServer:
        server: HangingServer = sim_loop.run(HangingServer(held).start())
        started.append(server)
        return server

    yield start
    for server in started:
        sim_loop.run(server.stop())


# --- healthy workers -----------------------------------------------------------------------


def test_healthy_worker_metrics_samples_and_deltas(simulator: StartSimulator) -> None:
    sim = simulator("m")
    worker = services.worker_add(url=sim.url, actor="test")

    assert probe_workers() == 1
    first = fresh(worker)
    assert first.state == "active" and first.consecutive_successes == 1
    assert first.metrics == {
        "running": 0,
        "waiting": 0,
        "kv_cache_usage": 0.0,
        "prefix_hit_rate": None,  # a rate needs two probes
        "ttft_p50": None,
        "ttft_p95": None,
        "rps": None,
        "vllm_series": ANY,
    }
    assert "vllm:num_requests_running" in first.metrics["vllm_series"]
    assert first.queue_length == 0
    assert first.last_probe_at is not None and first.last_error == ""
    assert first.scrape_state["prefix_queries"] == 0

    # The same 4-block prompt twice: the second finds 3 of its 4 blocks in the prefix cache
    # (as in vLLM, the last prompt token is always computed, so its block is never reused).
    prompt = " ".join(f"word{i}" for i in range(64))
    complete(sim.url, "m", prompt)
    complete(sim.url, "m", prompt)
    probe_workers()
    second = fresh(worker)
    assert second.metrics["prefix_hit_rate"] == pytest.approx(3 / 8)
    p50, p95 = second.metrics["ttft_p50"], second.metrics["ttft_p95"]
    assert p50 is not None and p95 is not None and 0 < p50 <= p95 < 10  # seconds, not ms
    assert second.metrics["rps"] > 0
    assert second.last_probe_at is not None and second.last_probe_at > first.last_probe_at

    samples = list(WorkerSample.objects.filter(worker=worker))
    assert [s.up for s in samples] == [True, True]
    assert samples[0].prefix_hit_rate is None
    assert samples[1].prefix_hit_rate == pytest.approx(3 / 8)
    assert samples[1].running == 0 and samples[1].waiting == 0
    assert samples[1].ttft_p50 == pytest.approx(p50)


def test_one_generation_bump_per_round(simulator: StartSimulator) -> None:
    workers = [services.worker_add(url=simulator(f"m{i}").url, actor="test") for i in range(3)]
    before = RoutingGeneration.current()
    assert probe_workers() == len(workers)
    assert RoutingGeneration.current() == before + 1


def test_router_sees_the_new_queue_length_within_a_second(
    simulator: StartSimulator, add_worker: AddWorker, router: RouterServer, sim_loop: SimulatorLoop
) -> None:
    sim = simulator("busy", max_batch=1, ttft_ms=3000)
    worker = add_worker(sim)
    assert router.workers()[worker.pk]["queue_length"] is None

    async def request() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await client.post(
                f"{sim.url}/v1/completions", json={"model": "busy", "prompt": "hi", "max_tokens": 1}
            )

    pending = [asyncio.run_coroutine_threadsafe(request(), sim_loop.loop) for _ in range(3)]
    try:
        wait_until(lambda: (sim.state.running, sim.state.waiting) == (1, 2))
        probe_workers()
        probed = fresh(worker)
        assert (probed.metrics["running"], probed.metrics["waiting"]) == (1, 2)
        assert probed.queue_length == 3
        wait_until(lambda: router.workers()[worker.pk]["queue_length"] == 3)
    finally:
        for future in pending:
            future.cancel()  # disconnects: the simulator drops the requests
        concurrent.futures.wait(pending, timeout=5)


# --- failing, hanging and recovering workers ---------------------------------------------


def test_unhealthy_after_three_failed_probes_and_back_after_two(simulator: StartSimulator) -> None:
    sim = simulator("m")
    worker = services.worker_add(url=sim.url, actor="test")
    httpx.post(f"{sim.url}/sim/control", json={"healthy": False}).raise_for_status()

    for failures in (1, 2):
        probe_workers()
        probed = fresh(worker)
        assert probed.state == "active", f"unhealthy after {failures} failures"
        assert probed.consecutive_failures == failures
        assert probed.last_error == "/health answered HTTP 503"
    assert not events("worker_unhealthy", worker)

    before = RoutingGeneration.current()
    probe_workers()
    probed = fresh(worker)
    assert probed.state == "unhealthy"
    (event,) = events("worker_unhealthy", worker)
    assert event.message == "3 failed probes: /health answered HTTP 503"
    assert event.actor == "probe"
    assert RoutingGeneration.current() >= before + 2  # the transition and the round
    assert not selectors.worker_view(probed, now=timezone.now()).routable
    # /metrics still answered, so the load signals stayed current.
    assert probed.metrics["running"] == 0
    assert [s.up for s in WorkerSample.objects.filter(worker=worker)] == [False] * 3

    httpx.post(f"{sim.url}/sim/control", json={"healthy": True}).raise_for_status()
    probe_workers()
    probed = fresh(worker)
    assert probed.state == "unhealthy" and probed.consecutive_successes == 1
    assert probed.consecutive_failures == 0
    probe_workers()
    probed = fresh(worker)
    assert probed.state == "active"
    (recovered,) = events("worker_recovered", worker)
    assert recovered.message == "2 successful probes"


def test_nothing_listening_is_connection_refused_and_metrics_unknown() -> None:
    worker = bare_worker(f"http://127.0.0.1:{free_port()}")
    for _ in range(3):
        probe_workers()
    probed = fresh(worker)
    assert probed.state == "unhealthy"
    assert events("worker_unhealthy", worker)[0].message == "3 failed probes: connection refused"
    assert probed.metrics == dict.fromkeys(probes.METRIC_KEYS)
    assert probed.queue_length is None


def test_a_hanging_worker_costs_the_round_one_timeout(
    simulator: StartSimulator,
    hanging_server: Callable[[], HangingServer],
    probe_settings: SettingsWrapper,
) -> None:
    # Long enough for the healthy simulators to answer on a busy machine, short enough
    # that the hanging ones cost the round a timeout that can be seen.
    probe_settings.CONTROLPANEL_PROBE_TIMEOUT = 3.0
    hung_servers = [hanging_server() for _ in range(2)]
    hung = [bare_worker(server.url) for server in hung_servers]
    healthy = [services.worker_add(url=simulator(f"m{i}").url, actor="test") for i in range(2)]

    started = time.monotonic()
    assert probe_workers() == 4
    elapsed = time.monotonic() - started
    # Timeout 3 s, which the round waited for: the two hanging servers' /health and
    # /metrics (at least) were held open at the same time, not one worker after another.
    assert elapsed >= 2.9, elapsed
    assert hung_servers[0].held.peak >= 2 * 2, hung_servers[0].held

    for worker in hung:
        probed = fresh(worker)
        assert probed.consecutive_failures == 1
        assert probed.last_error == "timed out after 3 s"
        assert probed.metrics["running"] is None
    for worker in healthy:
        probed = fresh(worker)
        assert probed.consecutive_successes == 1 and probed.metrics["running"] == 0


def test_probes_never_change_an_operators_state(simulator: StartSimulator) -> None:
    sim = simulator("m")
    worker = services.worker_add(url=sim.url, actor="test")
    Worker.objects.filter(pk=worker.pk).update(consecutive_failures=2)
    httpx.post(f"{sim.url}/sim/control", json={"healthy": False}).raise_for_status()

    # The probe ran while the worker was active; the operator drains it before the
    # result is applied. The result counts, but the drain stands.
    (result,) = probes.probe_many(health.probe_targets(), timeout=1.0)
    services.worker_drain(worker_id=worker.pk, actor="operator")
    assert health.probe_result_apply(result=result)
    probed = fresh(worker)
    assert probed.state in ("draining", "drained")
    assert probed.consecutive_failures == 3
    assert not events("worker_unhealthy", worker)

    probe_workers()  # and later rounds keep counting without touching the state
    probed = fresh(worker)
    assert probed.state in ("draining", "drained") and probed.consecutive_failures == 4
    assert probed.metrics["running"] == 0 and probed.last_probe_at is not None


# --- routers' reports and housekeeping ---------------------------------------------------


def test_passive_failures_count_like_failed_probes(simulator: StartSimulator) -> None:
    sim = simulator("m")
    worker = services.worker_add(url=sim.url, actor="test")
    assert not health.worker_passive_failures(
        worker_id=worker.pk, failures=2, cause="connection refused"
    )
    assert fresh(worker).state == "active" and fresh(worker).consecutive_failures == 2

    before = RoutingGeneration.current()
    assert health.worker_passive_failures(
        worker_id=worker.pk, failures=1, cause="connection refused"
    )
    probed = fresh(worker)
    assert probed.state == "unhealthy" and probed.consecutive_successes == 0
    (event,) = events("worker_unhealthy", worker)
    assert event.message == "1 failed request: connection refused (3 failures in a row)"
    assert event.actor == "router"
    assert RoutingGeneration.current() == before + 1

    # Probes that succeed bring it back, as after failed probes.
    probe_workers()
    probe_workers()
    assert fresh(worker).state == "active"
    assert not health.worker_passive_failures(worker_id=10**9, failures=3, cause="reset")


def test_a_burst_of_refused_requests_needs_no_probe(simulator: StartSimulator) -> None:
    worker = services.worker_add(url=simulator("m").url, actor="test")
    assert health.worker_passive_failures(
        worker_id=worker.pk, failures=5, cause="connection reset by peer"
    )
    (event,) = events("worker_unhealthy", worker)
    assert event.message == "5 failed requests: connection reset by peer"


def test_old_samples_are_pruned() -> None:
    worker = bare_worker(f"http://127.0.0.1:{free_port()}")
    now = timezone.now()
    old = WorkerSample.objects.create(worker=worker, at=now - timedelta(minutes=31), up=True)
    recent = WorkerSample.objects.create(worker=worker, at=now - timedelta(minutes=29), up=True)
    probe_workers()
    kept = set(WorkerSample.objects.filter(worker=worker).values_list("pk", flat=True))
    assert old.pk not in kept and recent.pk in kept and len(kept) == 2


def test_beat_schedules_this_task(settings: SettingsWrapper) -> None:
    (entry,) = [
        e for e in settings.CELERY_BEAT_SCHEDULE.values() if probe_workers.name in e["args"][0]
    ]
    assert entry["schedule"] == settings.CONTROLPANEL_PROBE_INTERVAL
    assert probe_workers.name == "controlpanel.probe_workers"
