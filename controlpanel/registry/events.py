"""The event log's one writer, its helper for settings changes (before → after, secrets
masked), and the nudge for changes made outside the services."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from datetime import date, datetime
from typing import Any

from django.db import transaction

from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Event, RoutingGeneration, Worker

# One human line per event on the console, once it is committed (settings.LOGGING).
log = logging.getLogger("controlpanel.events")

# Fields whose value never enters the log: a worker's sealed upstream key, a client key's
# hash. An event says only that one was set, changed or removed.
SECRET_FIELDS = frozenset({"api_key", "key_hash", "secret", "password"})
SET, CHANGED, REMOVED, NOT_SET = "set", "changed", "removed", "not set"


def event_record(
    *,
    kind: str,
    worker: Worker | None,
    message: str,
    actor: str,
    data: dict[str, Any] | None = None,
    subject: str = "",
) -> Event:
    """`subject`: what the event is about when it is not a worker (a model, a key...)."""
    event = Event.objects.create(
        kind=kind,
        worker=worker,
        subject=worker.url if worker else subject,
        message=message,
        actor=actor,
        data=data or {},
    )
    line = event_line(kind=kind, worker=worker.name if worker else "", message=message, actor=actor)
    transaction.on_commit(lambda: log.info("%s", line))
    return event


def event_record_change(
    *,
    kind: str,
    actor: str,
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    what: str = "",
    worker: Worker | None = None,
    subject: str = "",
    data: dict[str, Any] | None = None,
) -> Event | None:
    """Log the fields that differ between `before` and `after` as "what: field a → b", with
    `data` holding {"before": {...}, "after": {...}} of those fields only (secrets masked).
    Nothing changed: nothing logged, None."""
    diff = changes_masked(before, after)
    if diff is None:
        return None
    old, new = diff
    return event_record(
        kind=kind,
        worker=worker,
        subject=subject,
        message=f"{what}: {changes_text(old, new)}" if what else changes_text(old, new),
        actor=actor,
        data={**(data or {}), "before": old, "after": new},
    )


def changes_masked(
    before: Mapping[str, Any], after: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The changed fields' values before and after, as the log may keep them, or None."""
    fields = [f for f in dict.fromkeys([*before, *after]) if before.get(f) != after.get(f)]
    if not fields:
        return None
    old = {f: _masked_before(f, before.get(f)) for f in fields}
    new = {f: _masked_after(f, before.get(f), after.get(f)) for f in fields}
    return old, new


def masked(values: Mapping[str, Any]) -> dict[str, Any]:
    """Settings as the log may keep them, for a creation's "after": secrets as set/not set."""
    return {f: _masked_before(f, v) for f, v in values.items()}


def _masked_before(field: str, value: Any) -> Any:
    if field in SECRET_FIELDS:
        return SET if value else NOT_SET
    return plain(value)


def _masked_after(field: str, old: Any, value: Any) -> Any:
    if field in SECRET_FIELDS:
        return REMOVED if not value else CHANGED if old else SET
    return plain(value)


def plain(value: Any) -> Any:
    """A value the JSON column can hold and a person can read back (times as ISO text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Iterable):
        return [plain(v) for v in value]
    return str(value)


def changes_text(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """ "weight 1.0 → 2.0, name a → b": the line the console and the events page show."""
    return ", ".join(
        f"{field} {value_text(before.get(field))} → {value_text(after.get(field))}"
        for field in after
    )


def value_text(value: Any) -> str:
    if value is None:
        return "none"
    if value == "":
        return '""'
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def event_line(*, kind: str, worker: str, message: str, actor: str) -> str:
    """The console's line for an event: Worker degraded demo-2: 12 of 20 failed (by router)."""
    label = EventKind(kind).label.capitalize() if kind in EventKind.values else kind
    label = label.replace("Api key", "API key")
    return f"{label}{' ' + worker if worker else ''}: {message}" + (
        f" (by {actor})" if actor else ""
    )


def routing_changed() -> None:
    """For edits made outside the services (Django admin forms): tell the routers."""
    RoutingGeneration.bump()
