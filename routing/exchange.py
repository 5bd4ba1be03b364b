"""One request's exchange: its whole state, from its first byte in to its last byte out.

Created once per request (model routes and the router's own routes alike) and filled in as
the request is placed, so every step reads what it needs from one object: what the client
asked for and who it is, where the request went and why, what came back, and what the
telemetry records at the end (routing.telemetry: metrics, the access log, traces, the
cache check). Nothing about a request is kept anywhere else: not in the ASGI scope, not
on the policy that chose its worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from routing.admission.admission import STANDARD_RANK
from routing.asgi_types import Receive, Scope, Send
from routing.fleet.aliases import ModelNameRewriter, rewrite_request_model

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, MutableMapping

    from routing.fleet.client_keys import ClientKey
    from routing.fleet.snapshot import WorkerView
    from routing.peers.response_affinity import Holder
    from routing.policies.base import BasePolicy, Prediction, RequestInfo
    from routing.sessions import Session


@dataclass(slots=True, eq=False)
class Exchange:
    """One request, from arrival to last byte (see the module's docstring)."""

    scope: Scope
    receive: Receive
    send: Send  # wrapped by the usage meter once a client key is admitted (admission.auth)
    started: float  # perf_counter() at arrival
    # --- who asked, and for what ---------------------------------------------------------
    request_id: bytes = b""  # routing.telemetry.access_log; returned on every answer
    client: ClientKey | None = None  # the caller's key, once authenticated
    explain_asked: bool = False  # X-Route-Explain (routing.telemetry.explain)
    body: bytes = b""  # as forwarded: an alias's target spliced in, usage asked for
    rewriter: ModelNameRewriter | None = None  # renames an alias's answer back
    session: Session | None = None  # routing.sessions: read once, for every use
    # Priority class rank (0: critical), fair-queue flow (client key id; 0 without keys)
    # and its weight (routing.admission.admission).
    rank: int = STANDARD_RANK
    flow: int = 0
    weight: float = 1.0
    # --- where it went and why ------------------------------------------------------------
    model: str = ""  # the served model's name, once known (a bounded label)
    policy: BasePolicy = field(init=False)
    request: RequestInfo = field(init=False)
    worker: WorkerView = field(init=False)  # the current attempt's
    worker_id: int | None = None  # the worker that answered (or the last one tried)
    decision: str = ""  # the policy's kind of decision, for the recent-decisions ring
    prediction: Prediction | None = None  # a cache-aware policy's, checked on the answer
    attempts: int = 0
    # routing.telemetry.explain: the explanation, when the request asked and may have one.
    explain: dict[str, Any] | None = None
    # routing.fleet.fallbacks: the names still to try (those the client's key may use), the
    # hops taken (None: not falling back), and why the last try moved on (set only while a
    # fallback is left and nothing was sent).
    fallbacks: tuple[str, ...] = ()
    hops: list[dict[str, str]] | None = None
    fall_back_reason: str | None = None
    # routing.peers.response_affinity: the worker holding the response a follow-up
    # continues, and how it was found (for the access log).
    pinned: Holder | None = None
    pinned_shown: dict[str, Any] | None = None
    # routing.pd, for a disaggregated model's request: the prefill leg's worker, decision,
    # attempts and time, or why it was bypassed (None: not disaggregated).
    pd: dict[str, Any] | None = None
    # Run before each retry on another worker (None: nothing to redo); False when it
    # answered the client instead. A disaggregated request whose blocks were pushed to the
    # failed decode worker takes a new prefill leg here.
    before_retry: Callable[[Exchange], Awaitable[bool]] | None = None
    # --- per attempt ----------------------------------------------------------------------
    # Whether a failure before the first byte may go to another worker, whether the answer
    # went out whole and not as a 5xx (for the policy), whether it is complete, whether the
    # client left before it was, and whether the attempt's in-flight count was given back.
    may_retry: bool = False
    ok: bool = False
    answered: bool = False
    client_gone: bool = False
    released: bool = False
    # --- what came back -------------------------------------------------------------------
    status: int = 0  # 0: nothing sent yet
    first_byte: float | None = None
    # A cache-aware prediction checked against the answer (routing.telemetry.cache_check):
    # {"decision", "predicted", "reported", "block_size"}; None when none was checked.
    cache: dict[str, Any] | None = None

    def got_first_byte(self, now: float) -> None:
        self.first_byte = now
        self.policy.on_first_byte(self.worker, self.request)

    def move_on(
        self, payload: dict[str, Any], counts: MutableMapping[tuple[str, str, str], int]
    ) -> str:
        """Point the exchange at its next fallback and return its name. Called only when
        the last try set `fall_back_reason` (nothing was sent) and a fallback is left."""
        assert self.hops is not None and self.fall_back_reason is not None
        target, self.fallbacks = self.fallbacks[0], self.fallbacks[1:]
        asked = payload["model"]
        origin = self.hops[-1]["to"] if self.hops else asked
        reason = self.fall_back_reason
        hop = {"from": origin, "to": target, "reason": reason}
        self.hops.append(hop)
        self.fall_back_reason = None
        counts[origin, target, reason] = counts.get((origin, target, reason), 0) + 1
        if self.explain is not None:
            self.explain.setdefault("fallbacks", []).append(hop)
        # The body names the model the last try went to (its route's name).
        self.body = rewrite_request_model(self.body, payload, self.model, target)
        self.rewriter = ModelNameRewriter(target, asked)  # an alias target renames it again
        self.worker_id = None  # no worker of the new target chosen yet
        return target
