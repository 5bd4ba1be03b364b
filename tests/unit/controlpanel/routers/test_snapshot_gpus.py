"""The routing snapshot (controlpanel.routers.snapshot) carries the GPUs of fresh readings
only, and expires when they turn stale."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlpanel.fleet import gpu_health
from controlpanel.registry.models import Worker
from controlpanel.routers import snapshot as selectors
from tests.support.gpu import reading

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_snapshot_carries_fresh_gpus_and_expires_with_them() -> None:
    stale_after = gpu_health.stale_after()
    at = timezone.now() - timedelta(seconds=stale_after / 2)
    Worker.objects.create(
        url="http://fresh:8000", name="fresh", source="operator", models=[{"id": "m"}],
        gpus=[reading(0), reading(1)], gpus_source="nvml", gpus_at=at,
    )  # fmt: skip
    Worker.objects.create(
        url="http://stale:8000", name="stale", source="operator", models=[{"id": "m"}],
        gpus=[reading(0)], gpus_source="dcgm", gpus_at=at - timedelta(seconds=stale_after),
    )  # fmt: skip
    snapshot = selectors.routing_snapshot_build()
    views = {w.name: w for w in snapshot.workers}
    assert [g.index for g in views["fresh"].gpus] == [0, 1]
    assert views["fresh"].gpus[0].mem_total == 80 * 1024**3
    assert views["stale"].gpus == ()  # unknown: no series on /metrics
    # The router rebuilds when the fresh readings turn stale, even if nothing is written.
    assert snapshot.valid_until == pytest.approx(at.timestamp() + stale_after)
