"""The audit trail's before → after (controlpanel.registry.events), secrets masked, and what
the events page lists of it that an event's message does not say
(controlpanel.console.event_log)."""

from __future__ import annotations

from typing import Any

import pytest

from controlpanel.console.event_log import event_changes
from controlpanel.registry.events import changes_masked, changes_text
from controlpanel.registry.models import Event

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_change_helper_keeps_changed_fields_and_masks_secrets() -> None:
    diff = changes_masked(
        {"weight": 1.0, "name": "a", "api_key": "old", "kv_events": ""},
        {"weight": 2.0, "name": "a", "api_key": "new", "kv_events": "tcp://h:1"},
    )
    assert diff == (
        {"weight": 1.0, "api_key": "set", "kv_events": ""},
        {"weight": 2.0, "api_key": "changed", "kv_events": "tcp://h:1"},
    )
    assert (
        changes_text(*diff) == 'weight 1.0 → 2.0, api_key set → changed, kv_events "" → tcp://h:1'
    )
    assert changes_masked({"api_key": "k"}, {"api_key": ""}) == (
        {"api_key": "set"},
        {"api_key": "removed"},
    )
    assert changes_masked({"a": 1}, {"a": 1}) is None


def test_the_events_page_lists_what_the_message_does_not_say() -> None:
    def changes(message: str, before: dict[str, Any], after: dict[str, Any]) -> list[Any]:
        event = Event(
            kind="worker_changed", message=message, data={"before": before, "after": after}
        )
        return [(c.field, c.before, c.after) for c in event_changes(event)]

    assert changes("weight 1.0 → 2.0", {"weight": 1.0}, {"weight": 2.0}) == []
    assert changes("drain requested", {"state": "active"}, {"state": "draining"}) == [
        ("state", "active", "draining")
    ]
    # Unchanged fields are left out; a creation lists what is set; a removal what was.
    assert changes("m: a -> b", {"policy": "a", "policy_config": {}},
                   {"policy": "b", "policy_config": {}}) == [("policy", "a", "b")]  # fmt: skip
    assert changes("added", {}, {"name": "w", "dcgm_url": "", "api_key": "set"}) == [
        ("name", None, "w"), ("api_key", None, "set"),
    ]  # fmt: skip
    assert changes("deleted", {"targets": {"m": 100}}, {}) == [("targets", '{"m": 100}', None)]
    assert event_changes(Event(kind="worker_joined", message="x", data={})) == []
    # States read as everywhere else on the pages, never as their identifiers.
    assert changes("rolled back", {"state": "rolling_back"}, {"state": "rolled_back"}) == [
        ("state", "rolling back", "rolled back")
    ]
