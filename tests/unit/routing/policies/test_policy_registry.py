"""The policy registry (routing.policies): every policy by name, built with its default config or
refusing a bad one."""

from __future__ import annotations

from typing import Any

import pytest

from routing.policies import POLICIES, make_policy, policy_class
from routing.policies.base import BasePolicy
from routing.policies.least_kv import LeastKVPolicy
from routing.policies.power_of_two import PowerOfTwoPolicy
from routing.policies.round_robin import RoundRobinPolicy
from routing.policies.session_affinity import SessionAffinityPolicy
from routing.policies.weighted_random import WeightedRandomPolicy
from tests.support.policy_views import (
    NO_INFLIGHT,
    REQUEST,
    fleet,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_registered_policy_builds_with_default_config_and_selects(name: str) -> None:
    policy = make_policy(name)
    assert type(policy) is policy_class(name)
    assert policy.name == name
    workers = fleet(3)
    assert policy.select(workers, REQUEST, NO_INFLIGHT).worker in workers
    assert policy.select((), REQUEST, NO_INFLIGHT).worker is None


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("round_robin", RoundRobinPolicy),
        ("random", WeightedRandomPolicy),
        ("power_of_two", PowerOfTwoPolicy),
        ("least_kv", LeastKVPolicy),
        ("session_affinity", SessionAffinityPolicy),
    ],
)
def test_policies_are_registered_by_name(name: str, cls: type[BasePolicy]) -> None:
    assert policy_class(name) is cls
    assert not cls.needs_request_text


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("round_robin", {"start": 1}),
        ("random", {"weights": [1, 2]}),
        ("power_of_two", {"choices": 3}),
        ("least_kv", {"max_metric_age": 15}),  # misspelt
        ("least_kv", {"max_metrics_age": 0}),
        ("least_kv", {"max_metrics_age": -1}),
        ("least_kv", {"max_metrics_age": "15"}),
        ("least_kv", {"max_metrics_age": True}),
        ("least_kv", {"max_metrics_age": float("nan")}),
        ("least_kv", {"max_metrics_age": float("inf")}),
        ("least_kv", {"inflight_weight": -0.01}),
        ("least_kv", {"inflight_weight": None}),
        ("session_affinity", {"header": ""}),
        ("session_affinity", {"header": " X-Session-ID"}),
        ("session_affinity", {"header": 7}),
        ("session_affinity", {"header": "X-Sitzung-€"}),
        ("session_affinity", {"max_load": -1}),
        ("session_affinity", {"max_load": 1.5}),
        ("session_affinity", {"max_load": "32"}),
        ("session_affinity", {"max_load": False}),
        ("session_affinity", {"cache_size": -5}),
        ("session_affinity", {"sticky": True}),
    ],
)
def test_bad_config_raises_value_error(name: str, config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=name):
        policy_class(name)(config)


def test_good_config_is_read() -> None:
    kv = LeastKVPolicy({"max_metrics_age": 30, "inflight_weight": 0})
    assert (kv.max_metrics_age, kv.inflight_weight) == (30.0, 0.0)
    affinity = SessionAffinityPolicy({"header": "X-Conv", "max_load": 4.0, "cache_size": 0})
    assert (affinity.header, affinity.max_load, affinity.cache_size) == (b"x-conv", 4, 0)
    assert SessionAffinityPolicy().header is None  # the router's session key only
