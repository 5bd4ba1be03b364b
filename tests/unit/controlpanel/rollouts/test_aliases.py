"""Aliases (controlpanel.rollouts.aliases): what a name and its targets may be, the audit
trail of every change, and no weight or deletion while a rollout moves them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlpanel.fleet.errors import InvalidModelSetting
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Alias, Event, RolloutPlan, RoutingGeneration
from controlpanel.rollouts import aliases, plans, transitions

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("targets", "words"),
    [
        ({}, "non-empty object"),
        (["v1"], "non-empty object"),
        ({" ": 1}, "non-empty string"),
        ({"v1": True}, "integer from 0 to 10000"),
        ({"v1": 1.5}, "integer from 0 to 10000"),
        ({"v1": 10_001}, "integer from 0 to 10000"),
        ({"v1": -1}, "integer from 0 to 10000"),
        ({"v1": 0, "v2": 0}, "at least one target"),
    ],
)
def test_bad_targets_are_refused(targets: Any, words: str) -> None:
    with pytest.raises(aliases.InvalidAlias, match=words):
        aliases.alias_targets_clean(targets)


def test_targets_are_stripped_and_zero_weights_kept() -> None:
    assert aliases.alias_targets_clean({" v1 ": 0, "v2": 10_000}) == {"v1": 0, "v2": 10_000}


@pytest.mark.parametrize("name", ["", "-chat", "a b", "x" * 301, "chat?"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(aliases.InvalidAlias, match="an alias name is"):
        aliases.alias_create(name=name, targets={"v1": 1}, actor="test")


def test_creation_is_recorded_announced_and_once() -> None:
    before = RoutingGeneration.current()
    alias = aliases.alias_create(
        name=" org/chat@v1 ", targets={"v1": 90, "v2": 10}, description="d", actor="ops"
    )
    assert alias.name == "org/chat@v1" and RoutingGeneration.current() != before
    event = Event.objects.get(kind=EventKind.ALIAS_CHANGED)
    assert event.message == "alias org/chat@v1 created: v1 90, v2 10"
    assert event.data["before"] == {}
    assert event.data["after"] == {"targets": {"v1": 90, "v2": 10}, "description": "d"}
    with pytest.raises(aliases.AliasExists):
        aliases.alias_create(name="org/chat@v1", targets={"v1": 1}, actor="ops")
    with pytest.raises(aliases.InvalidAlias, match="its own target"):
        aliases.alias_create(name="self", targets={"self": 1}, actor="ops")


def test_fallbacks_are_checked_with_the_alias_in_place(chat: Alias) -> None:
    aliases.alias_update(name="chat", fallbacks=["v2"], actor="ops")
    assert aliases.aliases_fallbacks() == {"chat": ["v2"]}
    with pytest.raises(InvalidModelSetting):
        aliases.alias_update(name="chat", fallbacks=["no-such-model"], actor="ops")
    with pytest.raises(InvalidModelSetting):
        aliases.alias_create(name="chat2", targets={"v1": 1}, fallbacks=["chat2"], actor="ops")
    assert not Alias.objects.filter(name="chat2").exists()  # nothing kept of a refusal
    last = Event.objects.filter(kind=EventKind.ALIAS_CHANGED).latest("pk")
    assert last.message == "alias chat fallbacks (none) → v2"


def test_weights_and_deletion_wait_for_a_running_rollout(chat: Alias) -> None:
    steps = ({"weight": 10, "hold_seconds": 60}, {"weight": 100, "hold_seconds": 0})
    plan = plans.rollout_create(
        request=plans.PlanRequest(alias="chat", to_target="v2", steps=steps), actor="ops"
    )
    with pytest.raises(aliases.AliasBusy, match=f"rollout #{plan.pk} is running"):
        aliases.alias_update(name="chat", targets={"v1": 1}, actor="ops")
    with pytest.raises(aliases.AliasBusy, match="delete it"):
        aliases.alias_delete(name="chat", actor="ops")
    # what a rollout does not move may change meanwhile
    aliases.alias_update(name="chat", description="new", fallbacks=["v2"], actor="ops")
    assert Alias.objects.get(name="chat").description == "new"
    RolloutPlan.objects.filter(pk=plan.pk).update(state="completed")
    aliases.alias_delete(name="chat", actor="ops")  # finished plans go with it
    assert not Alias.objects.exists() and not RolloutPlan.objects.exists()
    with pytest.raises(aliases.AliasNotFound):
        aliases.alias_delete(name="chat", actor="ops")


def test_a_scheduled_plan_holds_the_alias_until_aborted(chat: Alias) -> None:
    """Deleting the alias used to delete its scheduled plan with it, silently."""
    later = timezone.now() + timedelta(hours=1)
    plan = plans.rollout_create(
        request=plans.PlanRequest(alias="chat", to_target="v2", start_at=later), actor="ops"
    )
    with pytest.raises(aliases.AliasBusy, match="has a scheduled plan; abort it first"):
        aliases.alias_delete(name="chat", actor="ops")
    assert RolloutPlan.objects.get(pk=plan.pk).state == "scheduled"
    transitions.rollout_action(plan_id=plan.pk, action="abort", actor="ops")
    aliases.alias_delete(name="chat", actor="ops")
    assert not RolloutPlan.objects.exists()


def test_routes_for_the_snapshot(chat: Alias) -> None:
    aliases.alias_update(name="chat", targets={"v1": 3, "v2": 1}, actor="ops")
    aliases.alias_create(name="other", targets={"v2": 1}, actor="ops")
    assert aliases.aliases_as_routes() == {"chat": {"v1": 3, "v2": 1}, "other": {"v2": 1}}
    assert aliases.aliases_fallbacks() == {}
    changed = Event.objects.filter(message__startswith="alias chat weights set").get()
    assert changed.data["before"] == {"targets": {"v1": 100}}
    assert changed.data["after"] == {"targets": {"v1": 3, "v2": 1}}
