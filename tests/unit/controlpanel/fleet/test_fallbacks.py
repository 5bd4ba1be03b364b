"""A served model's fallbacks (controlpanel.fleet.fallbacks): names known from every source
the router routes by, loops seen through aliases' fallbacks too, and a refusal changing
nothing."""

from __future__ import annotations

from typing import Any

import pytest

from controlpanel.fleet import fallbacks
from controlpanel.fleet.errors import InvalidModelSetting
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Alias, Event, ServedModel, Worker

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def names() -> None:
    for name in ("a", "b"):
        ServedModel.objects.create(name=name)
    Worker.objects.create(url="http://h:1", name="w", source="operator", models=[{"id": "lora"}])
    Alias.objects.create(name="chat", targets={"a": 1})


def test_every_routable_name_is_known() -> None:
    assert fallbacks.fallback_names() >= {"a", "b", "lora", "chat"}


def test_fallbacks_are_set_in_order_and_audited() -> None:
    fallbacks.served_model_set_fallbacks(name="a", fallbacks=[" lora ", "chat"], actor="ops")
    assert ServedModel.objects.get(name="a").fallbacks == ["lora", "chat"]
    event = Event.objects.get(kind=EventKind.MODEL_CHANGED)
    assert event.message == "a: fallbacks (none) → lora, chat"
    assert event.data["after"] == {"fallbacks": ["lora", "chat"]}
    fallbacks.served_model_set_fallbacks(name="a", fallbacks=[], actor="ops")
    assert Event.objects.latest("pk").message == "a: fallbacks lora, chat → (none)"


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ("b", "must be a list"),
        (["b", " "], "must be a list"),
        (["a"], "cannot fall back to itself"),
        (["b", "b"], "named twice"),
        (["nope"], "unknown fallback `nope`"),
        ([f"m{i}" for i in range(9)], "at most 8"),
    ],
)
def test_refused_lists_say_why_and_change_nothing(given: Any, words: str) -> None:
    with pytest.raises(InvalidModelSetting, match=words):
        fallbacks.served_model_set_fallbacks(name="a", fallbacks=given, actor="ops")
    assert ServedModel.objects.get(name="a").fallbacks == []
    assert not Event.objects.exists()


def test_a_loop_through_an_alias_is_refused() -> None:
    Alias.objects.filter(name="chat").update(fallbacks=["a"])
    fallbacks.served_model_set_fallbacks(name="b", fallbacks=["chat"], actor="ops")
    assert fallbacks.fallback_graph() == {"chat": ["a"], "b": ["chat"]}
    with pytest.raises(InvalidModelSetting, match="may not loop: a → b → chat → a"):
        fallbacks.served_model_set_fallbacks(name="a", fallbacks=["b"], actor="ops")
