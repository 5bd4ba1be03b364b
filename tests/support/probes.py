"""Probed workers in the end-to-end tier: a row for a server that cannot be discovered, a
worker read back fresh, its events of one kind, and a completion sent straight to a server."""

from __future__ import annotations

import httpx

from controlpanel.registry.choices import WorkerSource
from controlpanel.registry.models import Event, Worker


def bare_worker(url: str, model: str = "m") -> Worker:
    """A row for a server that cannot be discovered (dead or hanging)."""
    return Worker.objects.create(
        url=url, name=url, source=WorkerSource.OPERATOR, models=[{"id": model}]
    )


def fresh(worker: Worker) -> Worker:
    return Worker.objects.get(pk=worker.pk)


def events(kind: str, worker: Worker) -> list[Event]:
    return list(Event.objects.filter(kind=kind, worker=worker).order_by("id"))


def complete(url: str, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    httpx.post(f"{url}/v1/completions", json=body, timeout=10).raise_for_status()
