"""A router's configuration and state: everything that outlives one request.

:class:`RouterConfig` is what the operator sets; :class:`RouterState` holds what a router
process keeps between requests (the snapshot, in-flight counts and loads, the policies,
admission, the client gate, ejection, metrics, the KV index, the shared state) and swaps
in new snapshots. The router (routing.router) adds start-up, shutdown and its ASGI entry;
the request path (routing.proxy) reads and updates this state. Collectors and background
tasks read it through the small protocols of their own rooms (telemetry.router_view,
peers.fleet_sync), never through this class.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry

from routing.admission.admission import Admission
from routing.admission.auth import ClientGate
from routing.clients.ejection import Ejector
from routing.clients.failures import FailureLog
from routing.fleet.load_signal import DEFAULT_REPORT_MAX_AGE, LoadBoard
from routing.fleet.snapshot import ModelRoute, Snapshot, WorkerView
from routing.kv.kv_index import DEFAULT_MAX_BLOCKS_PER_WORKER, KvIndex
from routing.kv.kv_subscriber import KvSubscriber
from routing.peers import response_affinity
from routing.peers.decisions import DecisionRing, merged
from routing.peers.fleet_sync import FleetSync
from routing.policies import make_policy
from routing.policies.base import BasePolicy, PolicyContext
from routing.prompt.tokenize import RequestTokens, TokenizeCollector
from routing.sessions import DEFAULT_SOURCES, SessionReader
from routing.shared_store import SharedStore
from routing.telemetry.cache_check import CacheCheck, CacheCheckCollector
from routing.telemetry.counters import RouterMetrics
from routing.telemetry.metrics import RouterCollector
from routing.telemetry.tracing import tracer_from_env


@dataclass(frozen=True, slots=True)
class RouterConfig:
    connect_timeout: float = 5.0
    # For a free connection when the pool is full (max_connections_per_worker in use), then
    # connecting: past it the request fails like a connect timeout (retried elsewhere).
    pool_timeout: float = 30.0
    read_timeout: float = 600.0  # to the first byte, and between chunks; never overall
    max_body_bytes: int = 32 * 1024 * 1024
    body_timeout: float = 30.0  # seconds for the whole request body to arrive (else 408)
    max_header_bytes: int = 64 * 1024  # names and values together (else 431)
    require_api_key: bool = False  # client keys (routing.admission.auth)
    max_connections: int = 2048
    max_connections_per_worker: int = 512
    retry_after_seconds: int = 2
    retries: int = 2  # extra attempts on other workers, before the first byte only
    retry_backoff: float = 0.025  # seconds; doubled per attempt, jittered by +-50%
    # Consecutive failures that eject a worker (routing.clients.ejection); 0: off.
    eject_after: int = 5
    eject_cooldown: float = 5.0  # seconds, doubled on each repeated ejection
    # Per router process; 0: no limit (routing.admission.admission).
    max_inflight_per_worker: int = 0
    queue_timeout: float = 10.0  # seconds a request waits for room before its 429
    queue_max: int = 1000  # requests waiting per model before newcomers get 429 at once
    redis_url: str = ""  # shared state between routers (routing.shared_store, peers)
    # How long a worker's reported queue corrects the load (routing.policies.load).
    load_report_max_age: float = DEFAULT_REPORT_MAX_AGE
    load_push: bool = True  # with redis_url: push in-flight changes (routing.peers.load_push)
    kv_index_max_blocks: int = DEFAULT_MAX_BLOCKS_PER_WORKER  # per worker (routing.kv.kv_index)
    # Where a request's session key is read, in order (routing.sessions).
    session_sources: tuple[str, ...] = DEFAULT_SOURCES


class RouterState:
    """What a router process keeps between requests. `snapshot` is swapped by install()."""

    # Fleet gauges are the same in every replica; the control plane leaves this True on one
    # live router only, so they are not counted once per router (routing.telemetry.metrics).
    exports_fleet_metrics: bool = True

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config = config or RouterConfig()
        self.snapshot: Snapshot = Snapshot.empty()
        self.snapshot_error: str | None = None
        self.inflight: defaultdict[int, int] = defaultdict(int)  # this process's own
        # What the policies read: every router's in flight, corrected by reports.
        self.board = LoadBoard(self.inflight, report_max_age=config.load_report_max_age)
        self.loads = self.board.loads
        self.started_at = time.time()
        self.instance_id = uuid.uuid4().hex  # this process, to the control plane and peers
        self.metrics = RouterMetrics()
        self.ejector = Ejector(config.eject_after, config.eject_cooldown)
        self.failures = FailureLog(self.metrics.upstream_error, self.ejector)
        self.store = SharedStore(config.redis_url) if config.redis_url else None
        self.gate = ClientGate(self.store)  # client keys, rate limits, usage
        self.admission = Admission(
            config.max_inflight_per_worker, config.queue_timeout, config.queue_max
        )
        self.decisions = DecisionRing()  # each model's latest decisions
        # Routing state shared with the deployment's other routers.
        self.sync = (
            FleetSync(self, self.store, config.load_push) if self.store is not None else None
        )
        self.push = self.sync.push if self.sync is not None and config.load_push else None
        self.session: aiohttp.ClientSession | None = None  # the one upstream session
        self.tracer = tracer_from_env()  # OpenTelemetry: None unless configured
        self.tokens = RequestTokens()  # kv_aware's request tokens
        self.cache_check = CacheCheck()  # cache-aware predictions checked on the answers
        # Workers' KV caches from their own events, fed off the request path.
        self.kv_index = KvIndex(config.kv_index_max_blocks)
        self.kv_events = KvSubscriber(self.kv_index, lambda: self.snapshot)
        # Which worker holds each Responses API response (routing.peers.response_affinity).
        self.responses = response_affinity.ResponseAffinity(
            self.instance_id, self.store, lambda: self.snapshot.deployment,
            lambda: self.sync is not None and self.sync.peers > 0,
        )  # fmt: skip
        self.sessions = SessionReader(config.session_sources)
        self._policies: dict[tuple[str, str, bytes], BasePolicy] = {}
        self._route_policies: dict[str, BasePolicy] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RouterCollector(self))
        self.registry.register(TokenizeCollector(self.tokens))
        self.registry.register(CacheCheckCollector(self.cache_check, self.route_policies))

    def install(self, snapshot: Snapshot) -> None:
        """Swap in a new snapshot, resolving each model's policy now rather than per request.
        Both references change in one statement, so a request never sees a mix."""
        kept: dict[tuple[str, str, bytes], BasePolicy] = {}
        policies = {name: self._policy_for(route, kept) for name, route in snapshot.routes.items()}
        self.metrics.name_workers(snapshot.workers)
        self.ejector.forget({w.id for w in snapshot.workers})
        was_out = {w.id for w in self.snapshot.workers if not w.routable}
        self.ejector.readmit_recovered({w.id for w in snapshot.workers if w.routable} & was_out)
        self.snapshot, self._route_policies, self._policies = snapshot, policies, kept
        self.tokens.install(snapshot)  # new tokenizer folders load on a thread
        self.board.add_reports(
            {w.id: (w.queue_length or 0, w.queue_at) for w in snapshot.workers if w.queue_at}
        )
        self.board.refresh(time.time(), (w.id for w in snapshot.workers))
        self.kv_events.snapshot_changed()

    def _policy_for(
        self, route: ModelRoute, kept: dict[tuple[str, str, bytes], BasePolicy]
    ) -> BasePolicy:
        """Policies live across snapshot swaps while their configuration is unchanged, so
        stateful ones keep what they learned; unused ones are dropped."""
        key = (route.name, route.policy, orjson.dumps(dict(route.policy_config)))
        policy = self._policies.get(key)
        if policy is None:
            policy = make_policy(route.policy, route.policy_config)
            if self.sync is not None and policy.shares:
                policy.outbox = []  # shared from its first decision on
        # Again at every swap: the model's cap and its workers may have changed.
        policy.attach(PolicyContext(self.kv_index, slots_per_worker(route)))
        kept[key] = policy
        return policy

    def route_policies(self) -> Mapping[str, BasePolicy]:
        """The policy instance deciding for each model now."""
        return self._route_policies

    def recent_decisions(self) -> dict[str, list[dict[str, Any]]]:
        """Each model's latest decisions over this router and its peers, newest first."""
        peers = self.sync.peer_decisions if self.sync is not None else []
        return merged([self.decisions.snapshot(), *peers])

    def take_passive_failures(self) -> dict[int, tuple[int, str]]:
        """The failures seen since the last call, as worker id -> (count, last cause)."""
        return self.failures.take_passive()

    @property
    def passive_failures(self) -> Mapping[int, tuple[int, str]]:
        return self.failures.passive

    def admission_room(
        self, route: ModelRoute, workers: Sequence[WorkerView]
    ) -> dict[int, bool] | None:
        """Which workers have room under the in-flight limits now (None: no limits)."""
        if not self.admission.limits(route.max_inflight):
            return None
        return self.admission.room(route.name, workers, route.max_inflight, self.inflight)


def slots_per_worker(route: ModelRoute) -> int:
    """The model's cap on requests in flight shared over its routable workers, rounded up
    (0: no cap). A disaggregated model's policy chooses among its prefill workers."""
    workers = len(route.prefill or route.workers)
    return -(-route.max_inflight // workers) if route.max_inflight > 0 and workers else 0
