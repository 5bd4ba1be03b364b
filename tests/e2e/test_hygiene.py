"""Production hygiene through the real server: cookies scripts cannot read and other sites
cannot send, and CSRF on the dashboard's forms."""

from __future__ import annotations

import httpx
import pytest
from django.contrib.auth import get_user_model

from controlpanel.registry.models import ApiKey
from tests.support.servers import RouterServer

PASSWORD = "op-password-123"


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
