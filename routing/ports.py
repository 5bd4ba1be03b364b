"""The data plane's one port to the control plane, and the report that crosses it.

The router never imports the control plane: ``controlpanel.asgi`` hands the refresher an
object that satisfies ``SnapshotSource`` (``controlpanel.routers.snapshot`` implements it
with the ORM), and the refresher calls it from its own thread, never on a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from routing.admission.usage import UsageBatch
from routing.fleet.snapshot import Snapshot


@dataclass(frozen=True)
class RouterReport:
    """What one router process tells the control plane about itself, about once a second:
    that it is alive, what it has in flight (drains wait for it), what failed on real
    traffic (health acts on it) and what it served (rollout gates difference it)."""

    instance_id: str
    hostname: str
    pid: int
    started_at: float  # Unix time: the longest-running live router exports fleet gauges
    generation: int  # the snapshot the in-flight counts were taken with
    inflight: dict[int, int]  # worker id -> requests in flight now
    # worker id -> (consecutive failures on real traffic, the last cause)
    failures: dict[int, tuple[int, str]] = field(default_factory=dict)
    # worker id -> (requests, errors) over the router's last minute
    recent: dict[int, tuple[int, int]] = field(default_factory=dict)
    # worker id -> (requests, errors) since the router started: the control plane windows
    # them as it is configured (health from real traffic, live request rates)
    totals: dict[int, tuple[int, int]] = field(default_factory=dict)
    # model -> {"requests", "errors", "ttft": [bucket counts]} since the router started
    traffic: dict[str, dict[str, Any]] = field(default_factory=dict)
    # (worker id, "ejected" or "readmitted", why) since the last report
    ejections: list[tuple[int, str, str]] = field(default_factory=list)
    # worker id -> its KV events stream and index here (routing.kv.kv_subscriber.report)
    kv_events: dict[int, dict[str, Any]] = field(default_factory=dict)
    # model -> {"queued", "admitted", "shed": per priority class} (routing.admission.admission)
    classes: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    # (from, to, reason, count): requests moved on to a fallback (routing.fleet.fallbacks)
    fallbacks: list[tuple[str, str, str, int]] = field(default_factory=list)


class SnapshotSource(Protocol):
    def generation(self) -> int: ...

    def load(self) -> Snapshot: ...

    def report(self, report: RouterReport) -> bool:
        """Record the report; returns whether this router exports the fleet's gauges."""
        ...

    def load_reports(self) -> dict[int, tuple[int, float]]:
        """worker id -> (the queue it last reported, running + waiting; when, epoch s)."""
        ...

    def forget(self, *, instance_id: str) -> None: ...

    def record_usage(self, *, usage: UsageBatch) -> None: ...
