"""Plain ``WorkerView`` builders, for benchmarks that call a policy or the router's pages
in-process (the same factory as the policy tests')."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from routing.fleet.snapshot import ModelEntry, WorkerView

_BASE = WorkerView(
    id=0,
    name="w0",
    url="http://127.0.0.1:9000",
    state="active",
    source="operator",
    models=(ModelEntry("m"),),
    queue_length=0,
    last_heartbeat=None,
    routable=True,
)


def worker_view(worker_id: int, **changes: Any) -> WorkerView:
    """A routable worker serving model "m", named and addressed after its id."""
    fields = {"name": f"w{worker_id}", "url": f"http://127.0.0.1:{9000 + worker_id}"}
    return replace(_BASE, id=worker_id, **{**fields, **changes})
