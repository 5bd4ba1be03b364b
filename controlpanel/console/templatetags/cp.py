"""Formatting filters that show a missing reading as "unknown", never as zero."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django import template
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

from controlpanel.console.timefmt import time_label

register = template.Library()


def _missing(value: Any) -> bool:
    # A key absent from a metrics dict reaches a filter as "" (Django's string_if_invalid).
    return value is None or value == ""


def _unknown() -> SafeString:
    return mark_safe('<span class="unknown" title="not reported">unknown</span>')


@register.filter
def unknown(value: Any) -> Any:
    return _unknown() if _missing(value) else value


@register.filter
def percent(value: Any) -> Any:
    return _unknown() if _missing(value) else f"{float(value) * 100:.0f}%"


@register.filter
def millis(value: Any) -> Any:
    return _unknown() if _missing(value) else f"{float(value) * 1000:.0f} ms"


@register.filter
def decimal(value: Any, digits: int = 1) -> Any:
    return _unknown() if _missing(value) else f"{float(value):.{int(digits)}f}"


@register.simple_tag
def setting(name: str) -> Any:
    """A setting the pages explain themselves with (a window's length, a threshold)."""
    from django.conf import settings

    value = getattr(settings, name)
    return f"{value:g}" if isinstance(value, float) else value


@register.filter
def sev(severity: dict[str, str], cell: str) -> str:
    """The colour class of one of a row's cells: "sev-bad", "sev-warn" or ""."""
    level = severity.get(cell, "")
    return f"sev-{level}" if level else ""


@register.filter
def get(mapping: Any, key: Any) -> Any:
    """mapping[key] in a template, "" when absent."""
    return mapping.get(key, "") if isinstance(mapping, dict) else ""


@register.filter
def epoch_time(value: Any) -> str:
    """Unix seconds in the pages' one format: "2026-12-01 09:30:12 UTC"."""
    if not isinstance(value, int | float):
        return ""
    return time_label(value)


@register.filter
def when(value: Any) -> Any:
    """A datetime (Unix seconds, or ISO text as rollout history keeps it) as a <time>
    element in the pages' one format."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return value or "—"
    if isinstance(value, int | float):
        value = datetime.fromtimestamp(value, tz=UTC)
    if not isinstance(value, datetime):
        return "—"
    return format_html('<time datetime="{}">{}</time>', value.isoformat(), time_label(value))


@register.filter
def state_label(value: Any) -> str:
    """A state as people read it: `rolled_back` is "rolled back"."""
    return str(value).replace("_", " ")


@register.filter
def severity(event: Any) -> str:
    """An event's colour on the events page: "bad", "warn", "ok" or "info"."""
    from controlpanel.console.event_log import severity as event_severity

    return event_severity(event)


@register.filter
def changes(event: Any) -> list[Any]:
    """What an event changed, field by field (before → after), for its line on the pages."""
    from controlpanel.console.event_log import event_changes

    return event_changes(event)


@register.filter
def kind_label(kind: Any) -> str:
    """An event kind as the console's lines say it: "Worker joined", "API key created"."""
    from controlpanel.registry.choices import EventKind

    if kind not in EventKind.values:
        return str(kind)
    return EventKind(kind).label.capitalize().replace("Api key", "API key")
