"""A real Celery worker with beat (filesystem broker by default, Redis when REDIS_URL is set)
runs the housekeeping that marks silent agents' workers offline."""

from __future__ import annotations

import subprocess

import pytest

from controlpanel.registry.choices import WorkerSource
from controlpanel.registry.models import Event, Worker
from tests.support.servers import RouterServer, StartSimulator, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_celery_marks_a_silent_agent_worker_offline(
    celery_worker: subprocess.Popen[bytes], router: RouterServer, simulator: StartSimulator
) -> None:
    from controlpanel.fleet import services

    sim = simulator("m")
    worker = services.worker_register(url=sim.url)
    assert worker.source == WorkerSource.AGENT
    # Expiry is 3 s in the tests and beat runs the sweep every 0.5 s.
    wait_until(lambda: Worker.objects.get(pk=worker.pk).state == "offline")
    event = Event.objects.get(kind="worker_offline")
    assert event.actor == "heartbeat-expiry" and event.worker_id == worker.pk
    assert celery_worker.poll() is None
    services.worker_heartbeat(worker_id=worker.pk)
    assert Worker.objects.get(pk=worker.pk).state == "active"
