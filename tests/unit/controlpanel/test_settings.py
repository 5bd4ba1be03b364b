"""Bad configuration stops the process at start, with a message naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlpanel import envconf
from controlpanel.registry.models import normalize_worker_url
from tests.support.common import ROOT

BAD_VALUES = [
    ("CONTROLPANEL_HEARTBEAT_EXPIRY", "soon"),
    ("CONTROLPANEL_HEARTBEAT_EXPIRY", "0"),
    ("CONTROLPANEL_ADMIN_TOKEN", "short"),
    ("DATABASE_URL", "mysql://nope"),
    ("REDIS_URL", "localhost:6379"),
    ("DJANGO_DEBUG", "maybe"),
    ("CONTROLPANEL_MAX_BODY_BYTES", "12MB"),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_bad_environment_fails_loudly_at_start(name: str, value: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlpanel.settings",
        "CONTROLPANEL_VAR_DIR": str(tmp_path),
        name: value,
    }
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and name in result.stderr


def test_secret_file_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-a-file-0123456789\n")
    monkeypatch.setenv("X_TOKEN_FILE", str(secret))
    monkeypatch.setenv("X_TOKEN", "ignored")
    assert envconf.env_token("X_TOKEN") == "from-a-file-0123456789"
    monkeypatch.setenv("X_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfigured):
        envconf.env_token("X_TOKEN")


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("HTTP://GPU-1:8000/", "http://gpu-1:8000"),
        ("http://gpu-1:8000/v1", "http://gpu-1:8000"),
        ("http://gpu-1:8000/v1/", "http://gpu-1:8000"),
        ("https://host/prefix/v1", "https://host/prefix"),
        ("http://[::1]:9000", "http://[::1]:9000"),
    ],
)
def test_worker_urls_are_normalised(raw: str, normalized: str) -> None:
    assert normalize_worker_url(raw) == normalized
