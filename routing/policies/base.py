"""The one small interface every balancing policy implements.

A policy is a pure, synchronous choice among the routable workers of one model. It reads
the snapshot's WorkerViews and the router's live in-flight counts and never touches I/O.
Hooks let a stateful policy learn from traffic; they do nothing unless overridden.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from routing.snapshot import WorkerView


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about a request: its model, its parsed JSON body, the
    client's raw headers (as ASGI gives them: lower-case name and value bytes) and, only
    for a policy with `needs_request_text`, the prompt as text (routing.request_text)."""

    model: str
    body: Mapping[str, Any]
    raw_headers: Sequence[tuple[bytes, bytes]]
    text: str | None = None

    def header(self, name: bytes) -> str | None:
        """A request header by lower-case name, or None."""
        for key, value in self.raw_headers:
            if key == name:
                return value.decode("latin-1")
        return None


class Policy(Protocol):
    name: ClassVar[str]
    # When False the proxy never extracts prompt text for this policy (it costs CPU).
    needs_request_text: ClassVar[bool]

    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, inflight: Mapping[int, int]
    ) -> WorkerView | None: ...

    def on_request_start(self, worker: WorkerView, request: RequestInfo) -> None: ...

    def on_first_byte(self, worker: WorkerView, request: RequestInfo) -> None: ...

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None: ...


class BasePolicy(ABC):
    """No-op hooks, so a simple policy only writes select().

    `decisions` counts how choices were made, by a short reason ("prefix", "load",
    "fallback", ...); the router exports it per model and policy on /metrics, so an
    operator can see e.g. how often least_kv had no fresh metrics to go on."""

    name: ClassVar[str] = ""
    needs_request_text: ClassVar[bool] = False

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        self.decisions: Counter[str] = Counter()

    @abstractmethod
    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, inflight: Mapping[int, int]
    ) -> WorkerView | None:
        """Pick one of `workers` (all routable) or None when none should take the request."""

    def on_request_start(self, worker: WorkerView, request: RequestInfo) -> None:
        return None

    def on_first_byte(self, worker: WorkerView, request: RequestInfo) -> None:
        return None

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None:
        return None
