"""The pages Django shows when something failed: a database outage (503 with Retry-After,
within the pool's timeout) and a bug (500), styled like the dashboard and keeping its
navigation. Rendered without the request's context on purpose: the user and the messages
live in the session, in the very database that may be down."""

from __future__ import annotations

import logging
import sys

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string

from controlpanel.registry.errors import database_failed
from routing.errors import error_payload

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5


def server_error(request: HttpRequest) -> HttpResponse:
    if database_failed(sys.exc_info()[1]):
        return database_unavailable(request)
    if request.path.startswith("/api/"):
        return JsonResponse(error_payload(500, "internal error; see the server log"), status=500)
    return HttpResponse(render_to_string("500.html"), status=500)


def database_unavailable(request: HttpRequest) -> HttpResponse:
    log.error("%s %s: the database is unavailable", request.method, request.path)
    message = "the control plane's database is unavailable; retry shortly"
    if request.path.startswith("/api/"):
        payload = error_payload(503, message, kind="DatabaseError")
        response: HttpResponse = JsonResponse(payload, status=503)
    else:
        page = render_to_string("controlpanel/unavailable.html", {"path": request.path})
        response = HttpResponse(page, status=503)
    response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response
