"""A client key as the router sees it (routing.fleet.client_keys)."""

from __future__ import annotations

from routing.fleet.client_keys import ClientKey
from routing.fleet.priority import STANDARD


def test_a_key_without_models_may_use_every_model_and_a_limited_one_only_its_own() -> None:
    anything = ClientKey(id=1, name="a", prefix="cpk_aaaaaaaa", digest=b"x")
    limited = ClientKey(
        id=2, name="b", prefix="cpk_bbbbbbbb", digest=b"y", models=frozenset({"m", "chat"})
    )
    assert anything.allows("m") and anything.allows("anything-else")
    assert limited.allows("chat") and not limited.allows("m-large")


def test_a_key_is_standard_weight_one_and_unlimited_by_default() -> None:
    key = ClientKey(id=1, name="a", prefix="cpk_aaaaaaaa", digest=b"x")
    assert (key.priority, key.weight, key.explain) == (STANDARD, 1.0, False)
    assert (key.rpm, key.tpm, key.daily_tokens, key.monthly_tokens) == (None,) * 4
