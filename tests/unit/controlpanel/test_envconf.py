"""The environment's readers (controlpanel.envconf): each value read as typed, defaults when
unset, and every bad value refused with ImproperlyConfigured naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlpanel import envconf
from routing.sessions import DEFAULT_SOURCES

NAME = "CONTROLPANEL_TEST_ENVCONF"


@pytest.fixture(autouse=True)
def unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    monkeypatch.delenv(f"{NAME}_FILE", raising=False)


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("off", False),
        ("", False),
    ],
)
def test_booleans_in_their_spellings(
    monkeypatch: pytest.MonkeyPatch, raw: str, value: bool
) -> None:
    monkeypatch.setenv(NAME, raw)
    assert envconf.env_bool(NAME, not value) is value


def test_unset_values_take_their_defaults() -> None:
    assert envconf.env_bool(NAME, True) is True
    assert envconf.env_int(NAME, 7, minimum=100) == 7  # the default is not checked
    assert envconf.env_float(NAME, 0.5) == 0.5
    assert envconf.env_str(NAME, "d") == "d"
    assert envconf.env_token(NAME) == ""
    assert envconf.env_url(NAME, "", schemes=("redis",)) == ""
    assert envconf.env_session_sources(NAME) == DEFAULT_SOURCES


def test_blank_numbers_are_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "  ")
    assert envconf.env_int(NAME, 3) == 3
    assert envconf.env_float(NAME, 2.5) == 2.5


def test_numbers_are_read_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "5")
    assert envconf.env_int(NAME, 0, minimum=5) == 5
    assert envconf.env_float(NAME, 0.0, minimum=5.0) == 5.0
    with pytest.raises(ImproperlyConfigured, match=f"{NAME}=5 must be at least 6"):
        envconf.env_int(NAME, 0, minimum=6)
    with pytest.raises(ImproperlyConfigured, match=r"at least 5\.5"):
        envconf.env_float(NAME, 0.0, minimum=5.5)


@pytest.mark.parametrize(
    ("reader", "raw", "words"),
    [
        (lambda: envconf.env_bool(NAME, False), "maybe", "not a boolean"),
        (lambda: envconf.env_int(NAME, 0), "1.5", "not an integer"),
        (lambda: envconf.env_int(NAME, 0), "ten", "not an integer"),
        (lambda: envconf.env_float(NAME, 0.0), "fast", "not a number"),
        (lambda: envconf.env_token(NAME), "short", "at least 16 characters"),
        (lambda: envconf.env_url(NAME, "", schemes=("redis", "rediss")), "http://x", "redis://"),
        (lambda: envconf.env_session_sources(NAME), "x-session,x-session", "listed twice"),
        (lambda: envconf.env_session_sources(NAME), "body:model", "only"),
        (lambda: envconf.env_session_sources(NAME), "a b", "not an HTTP header"),
    ],
)
def test_bad_values_fail_loudly_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, reader: object, raw: str, words: str
) -> None:
    monkeypatch.setenv(NAME, raw)
    with pytest.raises(ImproperlyConfigured, match=NAME) as caught:
        reader()  # type: ignore[operator]
    assert words in str(caught.value)


def test_urls_of_an_allowed_scheme_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, " rediss://cache:6380/1 ")
    assert envconf.env_url(NAME, "", schemes=("redis", "rediss")) == "rediss://cache:6380/1"


def test_session_sources_are_read_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "X-Session-ID, body:user")
    assert envconf.env_session_sources(NAME) == ("x-session-id", "body:user")


def test_a_file_wins_over_the_variable_and_is_stripped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("from-the-file-0123456789\n")
    monkeypatch.setenv(NAME, "from-the-variable-0123")
    monkeypatch.setenv(f"{NAME}_FILE", str(secret))
    assert envconf.env_str(NAME) == "from-the-file-0123456789"
    assert envconf.env_token(NAME) == "from-the-file-0123456789"


def test_an_unreadable_file_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(f"{NAME}_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfigured, match=f"{NAME}_FILE=.*cannot be read"):
        envconf.env_str(NAME, "default")
