"""Registry rows for workers that are not a healthy vLLM, made without discovery."""

from __future__ import annotations

from controlpanel.registry.choices import WorkerSource
from controlpanel.registry.models import RoutingGeneration, ServedModel, Worker


def fake_worker(url: str, model: str = "m") -> Worker:
    """A registry row pointing at something that is not a healthy vLLM (no discovery)."""
    worker = Worker.objects.create(
        url=url, name=url, source=WorkerSource.OPERATOR, models=[{"id": model}]
    )
    ServedModel.objects.get_or_create(name=model)
    RoutingGeneration.bump()
    return worker
