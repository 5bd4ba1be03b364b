"""Small validating readers for settings that come from the environment, and the shape of
Celery beat's schedule built from them (`periodic_schedule`).

Every reader fails loudly with ImproperlyConfigured on a bad value, so a typo in a
deployment stops the process at start instead of surfacing as odd behaviour later.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from routing.sessions import parse_sources

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str = "") -> str:
    """A string; `NAME_FILE` pointing at a file wins, so secrets can come from mounts."""
    file_path = os.environ.get(f"{name}_FILE")
    if file_path:
        try:
            return Path(file_path).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE={file_path!r} cannot be read: {exc}") from exc
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from exc
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} must be at least {minimum}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from exc
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} must be at least {minimum}")
    return value


def env_token(name: str, *, min_length: int = 16) -> str:
    """A bearer token; empty means "not configured", too short is refused as guessable."""
    value = env_str(name).strip()
    if value and len(value) < min_length:
        raise ImproperlyConfigured(f"{name} must be at least {min_length} characters long")
    return value


def env_url(name: str, default: str, *, schemes: tuple[str, ...]) -> str:
    value = env_str(name, default).strip()
    if value and not value.startswith(tuple(f"{s}://" for s in schemes)):
        allowed = ", ".join(f"{s}://" for s in schemes)
        raise ImproperlyConfigured(f"{name}={value!r} must start with one of {allowed}")
    return value


def env_session_sources(name: str) -> tuple[str, ...]:
    """Where the router reads a request's session key, in order (routing.sessions): header
    names, comma-separated, `body:user` for the OpenAI `user` field; unset: the default."""
    raw = os.environ.get(name)
    try:
        return parse_sources(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r}: {exc}") from exc


PERIODIC_TASK = "controlpanel.periodic"  # controlpanel.celery.periodic


def periodic_schedule(tasks: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """Celery beat's schedule: one entry per interval, running that interval's tasks in
    order (controlpanel.celery.periodic); each expires unrun after its own interval."""
    by_interval: dict[float, list[str]] = {}
    for name, seconds in tasks.items():
        by_interval.setdefault(seconds, []).append(name)
    return {
        f"every-{seconds:g}s": {
            "task": PERIODIC_TASK,
            "schedule": seconds,
            "args": (names,),
            "options": {"expires": seconds},
        }
        for seconds, names in by_interval.items()
    }
