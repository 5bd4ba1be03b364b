"""Production hygiene: DEBUG off unless asked for, cookies scripts cannot read and other
sites cannot send, HTTPS-only cookies behind HTTPS, and CSRF on the dashboard's forms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model

from controlpanel.registry.models import ApiKey
from tests.conftest import ROOT, RouterServer

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


@pytest.mark.django_db(transaction=True)
def test_session_cookie_flags_and_csrf_on_dashboard_forms(router: RouterServer) -> None:
    get_user_model().objects.create_user("op", password=PASSWORD, is_staff=True)
    session = httpx.Client(base_url=router.url, timeout=10)
    session.get("/admin/login/")
    login = session.post(
        "/admin/login/?next=/keys/",
        data={
            "username": "op",
            "password": PASSWORD,
            "csrfmiddlewaretoken": session.cookies["csrftoken"],
        },
    )
    assert login.status_code == 302
    cookies = {c.split("=", 1)[0]: c.lower() for c in login.headers.get_list("set-cookie")}
    assert "httponly" in cookies["sessionid"] and "samesite=lax" in cookies["sessionid"]
    assert "secure" not in cookies["sessionid"].replace("samesite", "")
    # A forged form post (no CSRF token) from a logged-in browser does nothing.
    forged = session.post("/keys/new", data={"name": "forged"})
    assert forged.status_code == 403 and not ApiKey.objects.exists()
    token = session.cookies["csrftoken"]
    made = session.post("/keys/new", data={"name": "real", "csrfmiddlewaretoken": token})
    assert made.status_code == 200 and made.headers["cache-control"] == "no-store"
    assert ApiKey.objects.filter(name="real").exists()
