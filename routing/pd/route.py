"""A disaggregated model's request: its bypass, or its prefill leg and its decode leg's body.

:class:`Disaggregation` runs between choosing the model's route and admitting the
request: for a model with prefill workers it either lets a short prompt through to a
decode-capable worker as a colocated request (the bypass), or runs the prefill leg and
turns the exchange into the decode leg (the transfer parameters spliced into the client's
body, the worker chosen by load). Admission, retries on other decode workers with the
same parameters (NIXL's pull mode reads the blocks from the prefill worker whichever
worker asks), relaying and the client's disconnect then work as for any request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import aiohttp

from routing.exchange import Exchange
from routing.fleet.snapshot import ModelRoute
from routing.pd.bodies import FIELD, decode_body, prefill_body, uncached_tokens
from routing.pd.decode import DecodeByLoad
from routing.pd.prefill import BYPASS, PrefillLeg
from routing.policies.base import BasePolicy
from routing.state import RouterState

# Routes vLLM's disaggregated serving takes a prefill leg on: the OpenAI generation routes.
PD_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class Disaggregation:
    def __init__(
        self, state: RouterState, session: Callable[[], Awaitable[aiohttp.ClientSession]]
    ) -> None:
        self.metrics = state.metrics
        self.ejector = state.ejector
        self.prefill = PrefillLeg(state, session)
        self.decode_policy = DecodeByLoad()

    async def place(
        self, ex: Exchange, payload: dict[str, Any], route: ModelRoute, policy: BasePolicy
    ) -> bool:
        """Make `ex` the decode leg (or a bypass); False once the client has its answer."""
        if ex.scope["path"] not in PD_PATHS or FIELD in payload:
            return True  # not a generation route, or the client's own transfer: as sent
        prefill_workers = self.ejector.routable(route.prefill)
        ex.pd = {}
        if not prefill_workers:
            return self._bypass(ex, route, "no_prefill_worker")
        if uncached_tokens(ex.request) < route.pd_bypass_tokens:
            return self._bypass(ex, route, "short_prompt")
        params = await self.prefill.run(
            ex, prefill_body(payload, route.name), prefill_workers, policy, route.pd_bypass_tokens
        )
        if params is BYPASS:
            return self._bypass(ex, route, "cached_prompt")
        if params is None:
            return False
        self.metrics.pd_transfers[route.name] += 1
        if params.get("transfer_mode", "pull") != "pull":
            # Pushed blocks went to no worker in particular, or to one that may fail: a
            # retry on another decode worker needs a prefill leg of its own.
            ex.before_retry = partial(self._prefill_again, payload, route, policy, ex.body)
        ex.body = decode_body(ex.body, params)
        ex.policy = self.decode_policy
        return True

    async def _prefill_again(
        self,
        payload: dict[str, Any],
        route: ModelRoute,
        policy: BasePolicy,
        body: bytes,
        ex: Exchange,
    ) -> bool:
        """A new prefill leg before a decode retry, for a connector that does not pull."""
        workers = self.ejector.routable(route.prefill)
        params = await self.prefill.run(ex, prefill_body(payload, route.name), workers, policy)
        if params is None or params is BYPASS:
            return params is BYPASS
        self.metrics.pd_transfers[route.name] += 1
        ex.body = decode_body(body, params)
        return True

    def _bypass(self, ex: Exchange, route: ModelRoute, why: str) -> bool:
        """Straight to a decode-capable worker, by the model's own policy, as colocated."""
        self.metrics.pd_bypasses[route.name, why] += 1
        if ex.pd is not None:
            ex.pd["bypass"] = why
        if ex.explain is not None:
            ex.explain["prefill"] = {"bypass": why}
        return True
