"""Served models' settings (controlpanel.fleet.served_models) on the database: each checked
as the routers will use it, refused before anything changes, and changed with one event
(before → after) and one routing bump."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlpanel.fleet import served_models
from controlpanel.fleet.errors import InvalidModelSetting, InvalidPolicy, InvalidTokenizer
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Event, RoutingGeneration, ServedModel
from harness.tokenizer_folder import build_word_tokenizer_folder

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def model() -> ServedModel:
    served_models.served_models_ensure([{"id": "m"}, {"id": "m"}, {"id": "lora"}])
    return ServedModel.objects.get(name="m")


def last_event() -> Event:
    return Event.objects.latest("pk")


def test_ensure_makes_one_row_per_name() -> None:
    assert sorted(ServedModel.objects.values_list("name", flat=True)) == ["lora", "m"]


def test_a_policy_is_built_before_it_is_stored() -> None:
    before = RoutingGeneration.current()
    config = {"header": "x-user", "max_load": 4}
    changed = served_models.served_model_set_policy(
        name="m", policy="session_affinity", policy_config=config, actor="ops"
    )
    assert (changed.policy, changed.policy_config) == ("session_affinity", config)
    assert RoutingGeneration.current() != before
    event = last_event()
    assert event.kind == EventKind.POLICY_CHANGED
    assert event.message.startswith("m: shortest_queue -> session_affinity {")
    assert event.data["before"] == {"policy": "shortest_queue", "policy_config": {}}
    assert event.data["policy"] == "session_affinity"  # flat: the new values on top too


@pytest.mark.parametrize(
    ("policy", "config", "words"),
    [
        ("fastest", None, "unknown policy 'fastest'"),
        ("session_affinity", {"bogus": 1}, "unknown config key"),
        ("session_affinity", {"header": 5}, "header must be a header name"),
    ],
)
def test_a_policy_the_routers_could_not_build_is_refused(
    policy: str, config: dict[str, object] | None, words: str
) -> None:
    with pytest.raises(InvalidPolicy, match=words):
        served_models.served_model_set_policy(
            name="m", policy=policy, policy_config=config, actor="ops"
        )
    assert ServedModel.objects.get(name="m").policy == "shortest_queue"
    assert not Event.objects.exists()


def test_limits_reserve_and_bypass_are_bounded() -> None:
    served_models.served_model_set_limit(name="m", max_inflight=8, actor="ops")
    assert last_event().message == "m: at most 8 in flight per router (was no limit)"
    served_models.served_model_set_limit(name="m", max_inflight=0, actor="ops")
    assert last_event().message == "m: no limit (was 8)"
    for bad in (-0.1, 1.0):
        with pytest.raises(InvalidModelSetting, match="priority_reserve"):
            served_models.served_model_set_reserve(name="m", priority_reserve=bad, actor="ops")
    served_models.served_model_set_reserve(name="m", priority_reserve=0.5, actor="ops")
    reserve = last_event()
    assert reserve.kind == EventKind.MODEL_CHANGED
    assert set(reserve.data) == {"model", "before", "after"}  # not flat
    assert reserve.data["after"] == {"priority_reserve": 0.5}
    for bad in (-1, served_models.MAX_PD_BYPASS_TOKENS + 1):
        with pytest.raises(InvalidModelSetting, match="pd_bypass_tokens"):
            served_models.served_model_set_pd_bypass(name="m", pd_bypass_tokens=bad, actor="ops")
    served_models.served_model_set_pd_bypass(name="m", pd_bypass_tokens=0, actor="ops")
    assert last_event().message == "m: pd_bypass_tokens 256 → 0"
    row = ServedModel.objects.get(name="m")
    assert (row.max_inflight, row.priority_reserve, row.pd_bypass_tokens) == (0, 0.5, 0)


def test_preflight_is_warn_or_refuse() -> None:
    with pytest.raises(InvalidPolicy, match="not 'block'"):
        served_models.served_model_set_preflight(name="m", mode="block", actor="ops")
    served_models.served_model_set_preflight(name="m", mode="refuse", actor="ops")
    assert last_event().message == "m: preflight warn -> refuse"


def test_a_tokenizer_is_loaded_before_it_is_stored(tmp_path: Path) -> None:
    with pytest.raises(InvalidTokenizer, match="cannot be used"):
        served_models.served_model_set_tokenizer(
            name="m", tokenizer=str(tmp_path / "missing"), actor="ops"
        )
    folder = build_word_tokenizer_folder(tmp_path / "tok", ["hello", "world"])
    served_models.served_model_set_tokenizer(name="m", tokenizer=f" {folder} ", actor="ops")
    assert ServedModel.objects.get(name="m").tokenizer == str(folder)
    assert last_event().message == f"m: tokenizer (none) -> {folder}"
    served_models.served_model_set_tokenizer(name="m", tokenizer="", actor="ops")
    assert last_event().message == f"m: tokenizer {folder} -> (none)"


def test_an_unknown_model_changes_nothing() -> None:
    with pytest.raises(ServedModel.DoesNotExist):
        served_models.served_model_set_limit(name="nope", max_inflight=1, actor="ops")
    assert not Event.objects.exists()


def test_policy_knobs_come_from_the_policy_itself() -> None:
    knobs = served_models.policy_knobs("session_affinity")
    assert knobs["keys"] == ["cache_size", "header", "max_load"]
    assert '"max_load": 32' in knobs["example"]
    assert served_models.policy_knobs("round_robin") == {"keys": [], "example": "{}"}
