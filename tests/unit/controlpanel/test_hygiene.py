"""Production hygiene in the settings a fresh process gets: DEBUG off unless asked for,
cookies scripts cannot read and other sites cannot send, HTTPS-only cookies behind HTTPS.
The cookies and CSRF through the real server: tests/e2e/test_hygiene.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.common import ROOT

PASSWORD = "op-password-123"


def settings_of(tmp_path: Path, **env: str) -> dict[str, object]:
    """The security settings a fresh process gets from this environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "CONTROLPANEL_"))}
    code = (
        "import django, json; django.setup(); from django.conf import settings as s; "
        "print(json.dumps({n: getattr(s, n) for n in ('DEBUG', 'SESSION_COOKIE_SECURE', "
        "'CSRF_COOKIE_SECURE', 'SESSION_COOKIE_HTTPONLY', 'SESSION_COOKIE_SAMESITE', "
        "'CSRF_COOKIE_SAMESITE', 'CONTROLPANEL_REQUIRE_API_KEY')}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={
            **clean,
            "DJANGO_SETTINGS_MODULE": "controlpanel.settings",
            "CONTROLPANEL_VAR_DIR": str(tmp_path),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    values: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return values


def test_defaults_are_safe_and_https_makes_cookies_secure(tmp_path: Path) -> None:
    defaults = settings_of(tmp_path)
    assert defaults == {
        "DEBUG": False,
        "SESSION_COOKIE_SECURE": False,  # plain HTTP on a first run must still log in
        "CSRF_COOKIE_SECURE": False,
        "SESSION_COOKIE_HTTPONLY": True,
        "SESSION_COOKIE_SAMESITE": "Lax",
        "CSRF_COOKIE_SAMESITE": "Lax",
        "CONTROLPANEL_REQUIRE_API_KEY": False,
    }
    https = settings_of(tmp_path, CONTROLPANEL_HTTPS="1", CONTROLPANEL_REQUIRE_API_KEY="1")
    assert https["SESSION_COOKIE_SECURE"] is True and https["CSRF_COOKIE_SECURE"] is True
    assert https["CONTROLPANEL_REQUIRE_API_KEY"] is True
    assert settings_of(tmp_path, DJANGO_DEBUG="1")["DEBUG"] is True


def test_make_run_and_serve_do_not_turn_debug_on() -> None:
    makefile = (ROOT / "Makefile").read_text()
    serve = (ROOT / "controlpanel/console/management/commands/serve.py").read_text()
    assert "DJANGO_DEBUG" not in makefile and "DJANGO_DEBUG" not in serve
