"""The events page's reading of the event log: filters from the query string, the query they
make, and each event's severity (the colour the page gives it).

The filters are plain GET parameters, so a filtered view is a link an operator can share:
`kind` (repeatable), `severity`, `worker`, `actor`, `since` (15m, 1h, 6h, 24h, 7d), `from`
and `to` (datetime-local, in the deployment's zone), and `q`, searched in the message, the
subject, the actor and the worker's name. A value that makes no sense is dropped with a
message saying so, never a 500. `after` (an event id) asks for the newer events only: the
live page fetches those when the live feed says the log grew. `before` pages back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Max, Q, QuerySet
from django.http import QueryDict
from django.utils import timezone

from controlpanel.registry.choices import EventKind
from controlpanel.registry.events import value_text
from controlpanel.registry.models import Event

PAGE_SIZE = 200
SINCE = {"15m": 15, "1h": 60, "6h": 360, "24h": 1440, "7d": 10080}
SINCE_LABELS = {"15m": "15 min", "1h": "1 h", "6h": "6 h", "24h": "24 h", "7d": "7 days"}

# What each kind means for the operator on call: "bad" is trouble (out of the rotation,
# failing), "warn" needs a look (leaving, sleeping, differing), "ok" is trouble ending, and
# "info" a change someone made. A rollout's severity is its new state's (see severity).
KIND_SEVERITY: dict[str, str] = {
    EventKind.WORKER_OFFLINE: "bad",
    EventKind.WORKER_UNHEALTHY: "bad",
    EventKind.WORKER_DEGRADED: "bad",
    EventKind.WORKER_EJECTED: "bad",
    EventKind.GPU_WARNING: "warn",
    EventKind.WORKER_LEFT: "warn",
    EventKind.DRAIN_STARTED: "warn",
    EventKind.WORKER_SLEEPING: "warn",
    EventKind.PREFLIGHT: "warn",
    EventKind.API_KEY_REVOKED: "warn",
    EventKind.WORKER_JOINED: "ok",
    EventKind.WORKER_BACK: "ok",
    EventKind.WORKER_RECOVERED: "ok",
    EventKind.WORKER_READMITTED: "ok",
    EventKind.WORKER_ACTIVATED: "ok",
    EventKind.WORKER_AWAKE: "ok",
    EventKind.DRAIN_FINISHED: "ok",
    EventKind.GPU_CLEARED: "ok",
}
ROLLOUT_SEVERITY = {"rolling_back": "bad", "rolled_back": "bad", "aborted": "warn",
                    "paused": "warn", "completed": "ok"}  # fmt: skip
SEVERITIES = [("bad", "trouble"), ("warn", "needs a look"), ("ok", "recovered"),
              ("info", "changes")]  # fmt: skip


def severity(event: Event) -> str:
    if event.kind == EventKind.ROLLOUT:
        return ROLLOUT_SEVERITY.get(str((event.data or {}).get("to")), "info")
    return KIND_SEVERITY.get(event.kind, "info")


@dataclass
class EventFilters:
    kinds: list[str] = field(default_factory=list)
    severity: str = ""
    worker: int | None = None
    actor: str = ""
    since: str = ""
    start: datetime | None = None
    end: datetime | None = None
    q: str = ""
    after: int | None = None
    before: int | None = None
    errors: list[str] = field(default_factory=list)
    # What the form shows back, as typed (datetime-local text included).
    typed: dict[str, str] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.kinds or self.severity or self.worker or self.actor or self.since
                    or self.start or self.end or self.q)  # fmt: skip


def event_filters(params: QueryDict) -> EventFilters:
    """The filters a query string asks for; what makes no sense is named in `errors`."""
    f = EventFilters(typed={k: params.get(k, "").strip() for k in ("actor", "from", "to", "q")})
    known = set(EventKind.values)
    for kind in params.getlist("kind"):
        if kind in known:
            f.kinds.append(kind)
        elif kind:
            f.errors.append(f"No event kind {kind!r}; that filter is left out.")
    f.severity = _choice(params.get("severity", ""), dict(SEVERITIES), "severity", f.errors)
    f.since = _choice(params.get("since", ""), SINCE, "time range", f.errors)
    f.worker = _number(params.get("worker", ""), "worker", f.errors)
    f.after = _number(params.get("after", ""), "after", f.errors)
    f.before = _number(params.get("before", ""), "before", f.errors)
    f.actor, f.q = f.typed["actor"], f.typed["q"]
    f.start = _moment(f.typed["from"], "From", f.errors)
    f.end = _moment(f.typed["to"], "To", f.errors)
    return f


def _choice(value: str, allowed: dict[str, Any], what: str, errors: list[str]) -> str:
    if value and value not in allowed:
        errors.append(f"No {what} {value!r}; that filter is left out.")
        return ""
    return value


def _number(value: str, what: str, errors: list[str]) -> int | None:
    if not value:
        return None
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses (a 500).
    if value.isascii() and value.isdigit() and len(value) < 19:
        return int(value)
    errors.append(f"{what.capitalize()} {value!r} is not a number; that filter is left out.")
    return None


def _moment(value: str, what: str, errors: list[str]) -> datetime | None:
    if not value:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        errors.append(f"{what}: {value!r} is not a date and time (2026-12-01T09:30).")
        return None
    # datetime-local has no zone: it is the deployment's, as every time the pages show.
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


def events_query(f: EventFilters, now: datetime | None = None) -> QuerySet[Event]:
    events = Event.objects.select_related("worker")
    if f.kinds:
        events = events.filter(kind__in=f.kinds)
    if f.severity:
        events = events.filter(_severity_q(f.severity))
    if f.worker is not None:
        events = events.filter(worker_id=f.worker)
    if f.actor:
        events = events.filter(actor=f.actor)
    if f.since:
        events = events.filter(created_at__gte=(now or timezone.now()) - _since(f.since))
    if f.start:
        events = events.filter(created_at__gte=f.start)
    if f.end:
        events = events.filter(created_at__lte=f.end)
    if f.q:
        events = events.filter(
            Q(message__icontains=f.q) | Q(subject__icontains=f.q) | Q(actor__icontains=f.q)
            | Q(worker__name__icontains=f.q) | Q(kind__icontains=f.q)
        )  # fmt: skip
    if f.after is not None:
        events = events.filter(pk__gt=f.after)
    if f.before is not None:
        events = events.filter(pk__lt=f.before)
    return events


def _since(key: str) -> timedelta:
    return timedelta(minutes=SINCE[key])


def _severity_q(level: str) -> Q:
    """The kinds of one severity, rollouts by the state they moved to."""
    kinds = [k for k, v in KIND_SEVERITY.items() if v == level]
    states = [s for s, v in ROLLOUT_SEVERITY.items() if v == level]
    query = Q(kind__in=kinds) | Q(kind=EventKind.ROLLOUT, data__to__in=states)
    if level == "info":
        other = set(KIND_SEVERITY) | {EventKind.ROLLOUT}
        query = Q(kind__in=[k for k in EventKind.values if k not in other]) | (
            Q(kind=EventKind.ROLLOUT) & ~Q(data__to__in=list(ROLLOUT_SEVERITY))
        )
    return query


def latest_event_id() -> int:
    """The newest event's id (0 for none): the live feed sends it when it moves."""
    return Event.objects.order_by("-pk").values_list("pk", flat=True).first() or 0


def actors() -> list[str]:
    """Who has acted, for the actor filter: everyone in the log, the most recent first, at
    most 100 (one who acted long ago is still found through the search or a link)."""
    latest = (
        Event.objects.exclude(actor="")
        .values("actor")
        .annotate(latest=Max("pk"))
        .order_by("-latest")
        .values_list("actor", flat=True)
    )
    return list(latest[:100])


def kinds(*, also: list[str] | None = None) -> list[tuple[str, str]]:
    """The kinds the log holds (and `also`, the ones a link asks for), for the kind filter,
    in EventKind's order: a choice that can only ever show "no event" is noise to someone
    looking for what happened. The live page adds a kind when its first event arrives."""
    seen = set(Event.objects.order_by().values_list("kind", flat=True).distinct())
    seen.update(also or [])
    return [(value, label) for value, label in EventKind.choices if value in seen]


@dataclass(frozen=True)
class Change:
    field: str
    before: str | None  # None: the field is new (a creation)
    after: str | None  # None: gone with its row (a removal)


def _message_says(message: str, before: dict[str, Any], after: dict[str, Any]) -> bool:
    """The message already reads "field a → b" for every changed field (the change helper's
    words, or a service's own such as a key's or a fallback's)."""
    changed = [f for f in dict.fromkeys([*before, *after]) if before.get(f) != after.get(f)]
    return "→" in message and all(f"{field} " in message for field in changed)


def event_changes(event: Event) -> list[Change]:
    """What an event changed, field by field, from its data's `before` and `after`; empty
    when it says nothing the message does not (the change helper's own words are in it)."""
    data = event.data if isinstance(event.data, dict) else {}
    before, after = data.get("before"), data.get("after")
    if not isinstance(before, dict) or not isinstance(after, dict):
        return []
    if before and after and _message_says(event.message, before, after):
        return []
    if not before:  # a creation: what it was made with, not the empty defaults
        set_ = {f: v for f, v in after.items() if v not in (None, "", [], {})}
        return [Change(f, None, _shown(f, v)) for f, v in set_.items()]
    if not after:
        return [Change(f, _shown(f, v), None) for f, v in before.items()]
    fields = [f for f in dict.fromkeys([*before, *after]) if before.get(f) != after.get(f)]
    return [Change(f, _shown(f, before.get(f)), _shown(f, after.get(f))) for f in fields]


def _shown(field: str, value: Any) -> str:
    """A value as the pages show it; a state as people read it (`rolled_back`: "rolled
    back"), as every other place on the pages names states."""
    text = value_text(value)
    return text.replace("_", " ") if field == "state" else text
