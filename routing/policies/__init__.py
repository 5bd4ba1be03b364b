"""The balancing policies: which of a model's routable workers gets the next request.

What lives here: base.py, the one small interface (a synchronous `select` plus hooks that do
nothing by default); one module per policy; load.py and load_index.py, the load measure and
index the load-based policies share; and, in this file, the table that registers each
policy by name, so adding one touches this table and its own module only.

What it may import: the standard library, routing.fleet.snapshot (the WorkerViews it chooses
among), routing.policies.request_text and routing.kv.kv_index (kv_aware's exact index: plain data
the
router's KV event subscriber fills, read here without I/O). A policy is a pure function of
the snapshot, the request and the router's in-flight counts: no I/O and nothing to await,
nothing from routing.proxy or any other routing module, and nothing from Django or
controlpanel.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import Any

from routing.policies.base import BasePolicy, Policy, RequestInfo

log = logging.getLogger(__name__)

POLICIES: dict[str, str] = {
    "shortest_queue": "routing.policies.shortest_queue.ShortestQueuePolicy",
    "round_robin": "routing.policies.round_robin.RoundRobinPolicy",
    "random": "routing.policies.weighted_random.WeightedRandomPolicy",
    "power_of_two": "routing.policies.power_of_two.PowerOfTwoPolicy",
    "least_kv": "routing.policies.least_kv.LeastKVPolicy",
    "session_affinity": "routing.policies.session_affinity.SessionAffinityPolicy",
    "prefix_aware": "routing.policies.prefix_aware.PrefixAwarePolicy",
    "kv_aware": "routing.policies.kv_aware.KvAwarePolicy",
}
DEFAULT_POLICY = "shortest_queue"


class UnknownPolicy(ValueError):
    pass


def policy_class(name: str) -> type[BasePolicy]:
    try:
        dotted = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise UnknownPolicy(f"unknown policy {name!r}; known: {known}") from None
    module_name, _, class_name = dotted.rpartition(".")
    cls: type[BasePolicy] = getattr(importlib.import_module(module_name), class_name)
    return cls


def make_policy(name: str, config: Mapping[str, Any] | None = None) -> BasePolicy:
    """A policy instance; an unknown name (e.g. from a newer release's database) falls back
    to the default loudly, so routing never stops over a configuration mistake."""
    try:
        return policy_class(name)(config)
    except (UnknownPolicy, ValueError, TypeError) as exc:
        # The control plane refuses bad configurations when they are saved; this covers a
        # database written by another release. The default policy takes no configuration.
        log.error("policy %r cannot be built (%s); using %s", name, exc, DEFAULT_POLICY)
        return policy_class(DEFAULT_POLICY)(None)


__all__ = ["DEFAULT_POLICY", "POLICIES", "Policy", "RequestInfo", "make_policy", "policy_class"]
