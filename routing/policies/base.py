"""The one small interface every balancing policy implements.

A policy is a pure, synchronous choice among the routable workers of one model. It reads
the snapshot's WorkerViews and the router's live loads (routing.policies.load: one number per
worker, the same in every router) and never touches I/O.
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
    client's raw headers (as ASGI gives them: lower-case name and value bytes), only for
    a policy with `needs_request_text` the prompt as text (routing.request_text), and only
    for one with `needs_request_tokens` its token ids as the worker will see them, when
    they could be had (routing.tokenize; None otherwise), and its session key, read once by
    the router (routing.sessions: the configured headers, then `user`; None: none)."""

    model: str
    body: Mapping[str, Any]
    raw_headers: Sequence[tuple[bytes, bytes]]
    text: str | None = None
    tokens: Sequence[int] | None = None
    session: str | None = None

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
    # When True the proxy tokenizes the request first (routing.tokenize: a local tokenizer
    # or a hop to the worker's /tokenize), so only kv_aware pays for it.
    needs_request_tokens: ClassVar[bool]

    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> WorkerView | None: ...

    def on_request_start(self, worker: WorkerView, request: RequestInfo) -> None: ...

    def on_first_byte(self, worker: WorkerView, request: RequestInfo) -> None: ...

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None: ...


# One candidate as an explanation shows it: the worker's name and the numbers the policy
# decided by (load, matched prefix, rank, KV usage, ...), JSON-ready.
Candidate = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Explanation:
    """What a policy would do with a request, read-only: the kind of decision, the worker it
    would pick (None where the pick is random), and its best candidates, best first."""

    decision: str
    worker: WorkerView | None
    candidates: list[Candidate]


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a cache-aware policy expects the chosen worker's prefix cache to hold of the
    request it routed, for the router to check against the answer's
    usage.prompt_tokens_details.cached_tokens (routing.cache_check): `tokens` when the
    policy counts tokens (kv_aware); otherwise `share`, the part of the prompt it matched
    (prefix_aware, in bytes), which the check turns into tokens with the answer's
    prompt_tokens. `block_size`: what "within one block" means for this prediction."""

    request: RequestInfo
    worker_id: int
    tokens: int | None
    share: float
    block_size: int = 16


class BasePolicy(ABC):
    """No-op hooks, so a simple policy only writes select().

    `decisions` counts how choices were made, by a short reason ("prefix", "load",
    "fallback", ...); the router exports it per model and policy on /metrics, so an
    operator can see e.g. how often least_kv had no fresh metrics to go on. `last_decision`
    is the reason of the latest choice (the router's recent-decisions ring reads it).

    `explain` tells, without changing any state, what `select` would do and with which
    numbers (routing.explain: the X-Route-Explain header and the admin dry run). By default
    the candidates are ordered by load; a policy deciding by other numbers overrides it."""

    name: ClassVar[str] = ""
    needs_request_text: ClassVar[bool] = False
    needs_request_tokens: ClassVar[bool] = False
    default_decision: ClassVar[str] = "load"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        self.decisions: Counter[str] = Counter()
        self.last_decision = self.default_decision
        self.last_prediction: Prediction | None = None  # cache-aware policies set it

    def explain(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Explanation:
        ranked = sorted(workers, key=lambda w: loads.get(w.id, 0))
        rows = [{"worker": w.name, "load": loads.get(w.id, 0)} for w in ranked]
        return Explanation(self.default_decision, ranked[0] if ranked else None, rows)

    @abstractmethod
    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> WorkerView | None:
        """Pick one of `workers` (all routable) or None when none should take the request."""

    def on_request_start(self, worker: WorkerView, request: RequestInfo) -> None:
        return None

    def on_first_byte(self, worker: WorkerView, request: RequestInfo) -> None:
        return None

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None:
        return None
