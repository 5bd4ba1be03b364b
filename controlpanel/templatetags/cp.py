"""Formatting filters that show a missing reading as "unknown", never as zero."""

from __future__ import annotations

from typing import Any

from django import template
from django.utils.safestring import SafeString, mark_safe

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
