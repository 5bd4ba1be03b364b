"""The failure pages: a database outage is a 503 with Retry-After (JSON under /api/, the
styled page elsewhere), even raised from another error; any other bug a 500 in the same
two shapes. Rendered with no request context (the session is in the database)."""

from __future__ import annotations

import sys

import pytest
from django.db import OperationalError
from django.test import RequestFactory

from controlpanel.console import error_pages

FACTORY = RequestFactory()


def failing(exc: Exception, path: str) -> object:
    """The handler as Django calls it: inside the `except` of the failed view."""
    try:
        raise exc
    except type(exc):
        assert sys.exc_info()[1] is exc
        return error_pages.server_error(FACTORY.get(path))


@pytest.mark.parametrize("path", ["/api/workers", "/workers/3/"])
def test_a_database_outage_is_a_503_with_retry_after(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    answer = failing(OperationalError("could not connect"), path)
    assert answer.status_code == 503  # type: ignore[attr-defined]
    assert answer["Retry-After"] == str(error_pages.RETRY_AFTER_SECONDS)  # type: ignore[index]
    body = answer.content.decode()  # type: ignore[attr-defined]
    if path.startswith("/api/"):
        assert answer["Content-Type"] == "application/json"  # type: ignore[index]
        assert "the control plane's database is unavailable; retry shortly" in body
        assert '"type":"DatabaseError"' in body.replace(" ", "")
    else:
        assert "The control plane's database is unavailable" in body
        assert f'<a href="{path}">Retry now</a>' in body
    assert f"GET {path}: the database is unavailable" in caplog.text


def test_a_database_error_raised_from_another_is_still_the_outage() -> None:
    try:
        raise OperationalError("gone")
    except OperationalError as cause:
        wrapped = RuntimeError("rendering failed")
        wrapped.__cause__ = cause
    assert failing(wrapped, "/").status_code == 503  # type: ignore[attr-defined]


def test_any_other_error_is_a_500_in_the_same_two_shapes() -> None:
    api = failing(KeyError("bug"), "/api/keys")
    assert api.status_code == 500  # type: ignore[attr-defined]
    assert b"internal error; see the server log" in api.content  # type: ignore[attr-defined]
    page = failing(KeyError("bug"), "/keys/")
    assert page.status_code == 500  # type: ignore[attr-defined]
    assert b"<html" in page.content and not page.has_header("Retry-After")  # type: ignore[attr-defined]
