"""The one small interface every balancing policy implements.

A policy is a pure, synchronous choice among the routable workers of one model. It reads
the snapshot's WorkerViews and the router's live loads (routing.policies.load: one number per
worker, the same in every router) and never touches I/O.
Hooks let a stateful policy learn from traffic; they do nothing unless overridden.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from routing.fleet.snapshot import WorkerView
from routing.kv.kv_index import KvIndex


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about a request: its model, its parsed JSON body, the
    client's raw headers (as ASGI gives them: lower-case name and value bytes), only for
    a policy with `needs_request_text` the prompt as text (routing.policies.request_text), and only
    for one with `needs_request_tokens` its token ids as the worker will see them, when
    they could be had (routing.prompt.tokenize; None otherwise), and its session key, read once by
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


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What the router offers every policy it keeps, again at each snapshot (Policy.attach):
    kv_aware's exact index of the workers' KV caches (routing.kv.kv_index), and the model's
    cap on requests in flight shared over its routable workers (rounded up; 0: no cap)."""

    kv_index: KvIndex | None = None
    slots_per_worker: int = 0


def capped_guard(configured: float, slots_per_worker: int) -> float:
    """The cache-aware policies' load guard (``load - min_load > threshold``) under a model
    cap: a cap of 6 over 4 workers never lets the configured 32 (or 8) trip, so every session
    that shares a long system prompt piles onto one worker whose cache cannot hold them all.
    A worker holding more than its share of the cap over the least loaded is saturated."""
    return min(configured, slots_per_worker) if slots_per_worker > 0 else configured


# A policy's news for other routers: (worker id, the prompt's chunk or block hashes).
Credit = tuple[int, list[int]]


class Policy(Protocol):
    name: ClassVar[str]
    # When False the proxy never extracts prompt text for this policy (it costs CPU).
    needs_request_text: ClassVar[bool]
    # When True the proxy tokenizes the request first (routing.prompt.tokenize: a local tokenizer
    # or a hop to the worker's /tokenize), so only kv_aware pays for it.
    needs_request_tokens: ClassVar[bool]

    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Choice: ...

    def on_request_start(self, worker: WorkerView, request: RequestInfo) -> None: ...

    def on_first_byte(self, worker: WorkerView, request: RequestInfo) -> None: ...

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None: ...

    # What the router hands a new policy; a policy that needs router state takes it here.
    def attach(self, context: PolicyContext) -> None: ...

    # Sharing with other routers (routing.peers.fleet_sync): a policy with `shares` gets an
    # `outbox` of credits to publish, and takes the others' through `credit`, which says
    # whether it applied one; `shape` names its hashing, so only alike policies agree.
    shares: ClassVar[bool]
    outbox: list[Credit] | None

    @property
    def shape(self) -> str: ...

    def credit(self, worker_id: int, chain: list[int], shape: str) -> bool: ...


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
    usage.prompt_tokens_details.cached_tokens (routing.telemetry.cache_check): `tokens` when the
    policy counts tokens (kv_aware); otherwise `share`, the part of the prompt it matched
    (prefix_aware, in bytes), which the check turns into tokens with the answer's
    prompt_tokens. `block_size`: what "within one block" means for this prediction."""

    request: RequestInfo
    worker_id: int
    tokens: int | None
    share: float
    block_size: int = 16


NO_WORKER = "no_worker"  # the decision when no worker should take the request


@dataclass(frozen=True, slots=True)
class Choice:
    """What a policy decided for one request: the worker (None: none should take it), the
    kind of decision (counted per model on /metrics, shown in explanations and the
    recent-decisions ring), and a cache-aware policy's prediction of what the worker's
    prefix cache holds of the prompt (checked against the answer)."""

    worker: WorkerView | None
    decision: str
    prediction: Prediction | None = None


class BasePolicy:
    """No-op hooks, so a simple policy only writes pick().

    `decisions` counts how choices were made, by a short reason ("prefix", "load",
    "fallback", ...); the router exports it per model and policy on /metrics, so an
    operator can see e.g. how often least_kv had no fresh metrics to go on. What one
    request's choice was is the Choice `select` returns, never state left on the policy.
    A policy whose only kind of decision is `default_decision` writes `pick`; one that
    decides in several ways, or predicts, overrides `select`.

    `explain` tells, without changing any state, what `select` would do and with which
    numbers (routing.telemetry.explain: the X-Route-Explain header and the admin dry run). By
    default
    the candidates are ordered by load; a policy deciding by other numbers overrides it."""

    name: ClassVar[str] = ""
    needs_request_text: ClassVar[bool] = False
    needs_request_tokens: ClassVar[bool] = False
    default_decision: ClassVar[str] = "load"
    shares: ClassVar[bool] = False
    outbox: list[Credit] | None = None

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        self.decisions: Counter[str] = Counter()

    def explain(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Explanation:
        ranked = sorted(workers, key=lambda w: loads.get(w.id, 0))
        rows = [{"worker": w.name, "load": loads.get(w.id, 0)} for w in ranked]
        return Explanation(self.default_decision, ranked[0] if ranked else None, rows)

    def select(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> Choice:
        """Choose one of `workers` (all routable), or none when none should take it."""
        worker = self.pick(workers, request, loads)
        return Choice(worker, self.default_decision if worker is not None else NO_WORKER)

    def pick(
        self, workers: Sequence[WorkerView], request: RequestInfo, loads: Mapping[int, int]
    ) -> WorkerView | None:
        """The worker, for a policy whose only kind of decision is `default_decision`."""
        raise NotImplementedError(f"{type(self).__name__} implements neither pick nor select")

    def on_request_start(self, worker: WorkerView, request: RequestInfo) -> None:
        return None

    def on_first_byte(self, worker: WorkerView, request: RequestInfo) -> None:
        return None

    def on_request_complete(self, worker: WorkerView, request: RequestInfo, ok: bool) -> None:
        return None

    def attach(self, context: PolicyContext) -> None:
        return None

    def credit(self, worker_id: int, chain: list[int], shape: str) -> bool:
        return False

    @property
    def shape(self) -> str:
        return ""
