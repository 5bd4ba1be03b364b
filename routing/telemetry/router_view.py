"""What telemetry reads from a router: the one small state interface of this room.

Metrics collectors, the explain dry run and the admission families read a router's plain
state at scrape or request time through :class:`RouterView`, never the router's class:
routing.state.RouterState satisfies it, and telemetry imports nothing above itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from routing.admission.admission import Admission
from routing.admission.auth import ClientGate
from routing.clients.ejection import Ejector
from routing.fleet.snapshot import ModelRoute, Snapshot, WorkerView
from routing.kv.kv_subscriber import KvSubscriber
from routing.peers.fleet_sync import FleetSync
from routing.policies.base import BasePolicy
from routing.prompt.tokenize import RequestTokens
from routing.sessions import SessionReader
from routing.telemetry.counters import RouterMetrics


class RouterView(Protocol):
    """A router's state as telemetry reads it (see routing.state.RouterState)."""

    @property
    def metrics(self) -> RouterMetrics: ...

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def inflight(self) -> Mapping[int, int]: ...

    @property
    def loads(self) -> Mapping[int, int]: ...

    @property
    def admission(self) -> Admission: ...

    @property
    def gate(self) -> ClientGate: ...

    @property
    def ejector(self) -> Ejector: ...

    @property
    def sync(self) -> FleetSync | None: ...

    @property
    def kv_events(self) -> KvSubscriber: ...

    @property
    def tokens(self) -> RequestTokens: ...

    @property
    def sessions(self) -> SessionReader: ...

    @property
    def exports_fleet_metrics(self) -> bool: ...

    def route_policies(self) -> Mapping[str, BasePolicy]: ...

    def recent_decisions(self) -> dict[str, list[dict[str, Any]]]: ...

    def admission_room(
        self, route: ModelRoute, workers: Sequence[WorkerView]
    ) -> dict[int, bool] | None: ...
