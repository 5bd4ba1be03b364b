"""The routing dry run: what the router would do with a request body, changing nothing."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest
from ninja import Body, Router
from ninja.errors import HttpError

from controlpanel.api.auth import ADMIN_AUTH
from routing.telemetry import explain

router = Router()


@router.post("/route/explain", auth=ADMIN_AUTH, tags=["routing"])
def route_explain(request: HttpRequest, payload: Body[dict[str, Any]]) -> Any:
    """The X-Route-Explain answer for this body (with `model`, as it would be sent to
    /v1/...), from the router serving this call: the policy's candidates and the numbers it
    uses, the decision and worker it would make now. Nothing is forwarded, counted or
    learned. The session headers (CONTROLPANEL_SESSION_HEADERS) and `X-Priority` count as
    they would on the real request."""
    wanted = {*settings.ROUTER_SESSION_SOURCES, "x-priority"}
    headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in request.headers.items()
        if name.lower() in wanted
    ]
    try:
        told = explain.on_router(lambda app: explain.dry_run(app, payload, headers))
    except ValueError as exc:
        raise HttpError(422, str(exc)) from exc
    except LookupError as exc:
        raise HttpError(404, str(exc)) from exc
    if told is None:
        raise HttpError(503, "no router runs in this process; ask a router's /api")
    return told


@router.get("/route/decisions", auth=ADMIN_AUTH, tags=["routing"])
def route_decisions(request: HttpRequest, model: str = "") -> Any:
    """Each model's latest decisions (up to 50), newest first, merged over every router of
    the deployment (through Redis; without it, this router's own): time, worker, decision,
    attempts, status, and the explanation when the request asked for one."""
    recent = explain.on_router(lambda app: app.recent_decisions()) or {}
    return {model: recent.get(model, [])} if model else recent
