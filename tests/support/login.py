"""An operator's logged-in session on a router's dashboard, over real HTTP."""

from __future__ import annotations

import httpx
from django.contrib.auth import get_user_model

from tests.support.servers import RouterServer


def logged_in(router: RouterServer) -> httpx.Client:
    get_user_model().objects.create_user("op", password="op-password-123", is_staff=True)
    session = httpx.Client(base_url=router.url, timeout=10)
    form = session.get("/admin/login/")
    token = session.cookies["csrftoken"]
    response = session.post(
        "/admin/login/?next=/",
        data={"username": "op", "password": "op-password-123", "csrfmiddlewaretoken": token},
        headers={"Referer": f"{router.url}/admin/login/"},
    )
    assert form.status_code == 200 and response.status_code == 302
    return session
