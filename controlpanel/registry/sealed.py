"""Secrets the control plane must send on (a worker's upstream API key), sealed at rest.

They cannot be hashed like client keys: the router needs the key itself to call the worker.
So the database holds a Fernet token (AES-128-CBC with an HMAC-SHA256) under a key derived
from SECRET_KEY, and Python code only ever sees the clear value: a database dump, a backup
or a read-only SQL login no longer hands out the keys of every vLLM server.

Rotation follows Django's own: put the old secret in DJANGO_SECRET_KEY_FALLBACKS, and values
sealed under it still open (and are sealed under the new secret when next saved). A value
that opens under no key reads as "" and is logged: the worker then answers 401, its page says
to set the key, and nothing crashes. A stored value without the prefix is a key saved before
sealing existed; it reads as it is and is sealed the next time the row is saved.
"""

from __future__ import annotations

import base64
import logging
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import models
from django.utils.crypto import salted_hmac

if TYPE_CHECKING:
    from cryptography.fernet import Fernet, MultiFernet

log = logging.getLogger(__name__)

PREFIX = "sealed:v1:"
SALT = "controlpanel.sealed.worker-secret"


@lru_cache(maxsize=4)
def _box(secret: str, fallbacks: tuple[str, ...]) -> MultiFernet:
    # Imported here, not at the top: cryptography costs a process ~9 MiB, and one that never
    # meets a sealed secret (a router whose workers have no API key) should not pay it.
    from cryptography.fernet import Fernet, MultiFernet

    def fernet(source: str) -> Fernet:
        digest = salted_hmac(SALT, "fernet", secret=source, algorithm="sha256").digest()
        return Fernet(base64.urlsafe_b64encode(digest))

    return MultiFernet([fernet(secret), *(fernet(old) for old in fallbacks)])


def box() -> MultiFernet:
    return _box(settings.SECRET_KEY, tuple(settings.SECRET_KEY_FALLBACKS))


def seal(value: str) -> str:
    if not value:
        return ""
    return PREFIX + box().encrypt(value.encode()).decode("ascii")


def unseal(stored: str) -> str:
    if not stored.startswith(PREFIX):
        return stored  # saved before sealing existed, or empty
    from cryptography.fernet import InvalidToken  # loaded by box() anyway (see _box)

    try:
        return box().decrypt(stored[len(PREFIX) :].encode("ascii")).decode()
    except (InvalidToken, UnicodeError, ValueError):
        log.error(
            "a sealed secret does not open under SECRET_KEY or its fallbacks; it reads as "
            "empty until it is set again (did SECRET_KEY change without a fallback?)"
        )
        return ""


class SealedCharField(models.TextField):  # type: ignore[type-arg]
    """A text field whose value is sealed in the database and clear in Python. It cannot be
    searched or compared in SQL (every seal of one value differs), only read and written."""

    def from_db_value(self, value: str | None, expression: Any, connection: Any) -> str | None:
        return None if value is None else unseal(value)

    def get_prep_value(self, value: Any) -> Any:
        value = super().get_prep_value(value)
        return seal(value) if isinstance(value, str) else value
