"""The fixtures of more than one tier: the real ASGI server (uvicorn) in a subprocess on the
test database, one requiring client API keys, simulated vLLM workers on their own ports, a
Celery worker; and the session's rules (realvllm/ only when asked for, no skip where every
service is there). Each tier's own fixtures are in its conftest (unit/, e2e/, browser/,
realvllm/); the helpers they are built on, and that tests import, in tests/support/.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from django.core.management.base import CommandError
from django.test import TransactionTestCase

from controlpanel.fleet import services
from controlpanel.registry.models import Worker
from simulator.config import SimConfig
from simulator.server import RunningSimulator, start_simulator
from tests.support.servers import (
    RouterServer,
    SimulatorLoop,
    start_celery,
    start_router,
    stop_process,
)

# The real-vLLM tier (tests/realvllm) starts real vLLM servers: collected only when asked
# for (make test-real-vllm, .ci/run), where nothing in it may skip.
REAL_VLLM = os.environ.get("CONTROLPANEL_REAL_VLLM") == "1"
collect_ignore_glob = [] if REAL_VLLM else ["realvllm/*"]


_flush_tables = TransactionTestCase._fixture_teardown  # type: ignore[attr-defined]


def _flush_tables_retrying(self: TransactionTestCase) -> None:
    """A transactional test's teardown truncates every table while the session's router
    may be writing its report (several tables in one transaction): PostgreSQL can then
    break the deadlock by failing the TRUNCATE. That is the suite's race, not the code's,
    so the flush is tried again."""
    for attempt in range(3):
        try:
            _flush_tables(self)
            return
        except CommandError as exc:
            if attempt == 2 or "deadlock" not in str(exc.__cause__):
                raise
            time.sleep(0.5)


TransactionTestCase._fixture_teardown = _flush_tables_retrying  # type: ignore[attr-defined]


# --- the router ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def var_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("var")


@pytest.fixture(scope="session")
def router(django_db_setup: None, django_db_blocker: Any, var_dir: Path) -> Iterator[RouterServer]:
    with django_db_blocker.unblock():
        server = start_router(var_dir)
    yield server
    stop_process(server.proc)


@pytest.fixture
def client(router: RouterServer) -> openai.OpenAI:
    """The official OpenAI client on the session's router (in place of pytest-django's
    `client`: the e2e and real-vLLM tiers use it)."""
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="not-checked", max_retries=0)


@pytest.fixture(scope="module")
def keyed_router(
    django_db_setup: None, django_db_blocker: Any, var_dir: Path
) -> Iterator[RouterServer]:
    """A router of the module's that requires client API keys (tests.support.keyed)."""
    with django_db_blocker.unblock():
        server = start_router(var_dir, CONTROLPANEL_REQUIRE_API_KEY="1")
    yield server
    stop_process(server.proc)


# --- simulated workers and Celery -----------------------------------------------------------


@pytest.fixture(scope="session")
def sim_loop() -> SimulatorLoop:
    return SimulatorLoop()


@pytest.fixture
def simulator(sim_loop: SimulatorLoop) -> Iterator[Callable[..., RunningSimulator]]:
    started: list[RunningSimulator] = []

    def start(model: str = "sim-model", **config: Any) -> RunningSimulator:
        config.setdefault("ttft_ms", 1)
        config.setdefault("itl_ms", 1)
        sim: RunningSimulator = sim_loop.run(start_simulator(SimConfig(model=model, **config)))
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim_loop.run(sim.stop())


@pytest.fixture
def add_worker(router: RouterServer) -> Callable[..., Worker]:
    """Register a simulator through the service layer and wait until the router routes to it."""

    def add(sim: RunningSimulator, name: str = "") -> Worker:
        worker = services.worker_add(url=sim.url, name=name, actor="test")
        router.wait_routable(worker)
        return worker

    return add


@pytest.fixture
def celery_worker(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = start_celery(tmp_path)
    yield proc
    stop_process(proc)
    print((tmp_path / "celery.log").read_text(errors="replace")[-3000:])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """With CONTROLPANEL_TESTS_NO_SKIP=1 (CI's PostgreSQL + Redis tier, which has every
    service) a skipped test fails instead: the tests that skip without Redis must run there."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and os.environ.get("CONTROLPANEL_TESTS_NO_SKIP") == "1":
        report.outcome = "failed"
        report.longrepr = f"skipped in a tier that must run every test: {report.longrepr}"


@pytest.fixture(autouse=True)
def _probe_round_timers() -> Iterator[None]:
    """Each test's first probe round prunes history and runs preflight, as a fresh Celery
    worker's does (controlpanel.fleet.health: at most once a minute otherwise)."""
    from controlpanel.fleet import health

    health.round_timers_reset()
    yield
