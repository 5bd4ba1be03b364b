"""The NinjaAPI instance, its error handlers (the OpenAI error shape, like the router's) and
the routers of every domain, mounted in the order their paths must be matched."""

from __future__ import annotations

import json
import logging
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from ninja import NinjaAPI, Swagger
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.openapi.docs import _csrf_needed

from controlpanel.api import agents, explain, keys, rollouts, served_models, workers
from controlpanel.registry import errors
from controlpanel.registry.models import ServedModel, Worker
from routing.errors import error_payload

log = logging.getLogger(__name__)


class OfflineSwagger(Swagger):
    """Swagger UI from ninja's own assets, served here, never its CDN: ninja falls back to the
    CDN whenever "ninja" is not an installed app, and it is not one (settings.NINJA_DIR says
    why), so this renders ninja's template as ninja does for an installed app."""

    def render_page(self, request: HttpRequest, api: NinjaAPI, **kwargs: Any) -> HttpResponse:
        self.settings["url"] = self.get_openapi_url(api, kwargs)
        context = {
            "swagger_settings": json.dumps(self.settings, indent=1),
            "api": api,
            "add_csrf": _csrf_needed(api),
        }
        return render(request, self.template, context)


api = NinjaAPI(
    title="vLLM Control Panel API",
    version="1",
    description="Manage the workers behind the router. Admin calls take "
    "`Authorization: Bearer $CONTROLPANEL_ADMIN_TOKEN` or a staff session; agent calls take "
    "`Authorization: Bearer $CONTROLPANEL_WORKER_TOKEN`.",
    urls_namespace="api",
    docs=OfflineSwagger(),
)


def _error(request: HttpRequest, status: int, message: str, kind: str) -> HttpResponse:
    return api.create_response(request, error_payload(status, message, kind=kind), status=status)


@api.exception_handler(errors.ServiceError)
def _service_error(request: HttpRequest, exc: errors.ServiceError) -> HttpResponse:
    return _error(request, exc.status, str(exc), type(exc).__name__)


@api.exception_handler(Worker.DoesNotExist)
def _no_worker(request: HttpRequest, exc: Exception) -> HttpResponse:
    return _error(request, 404, "no such worker; register again", "NotFoundError")


@api.exception_handler(ServedModel.DoesNotExist)
def _no_model(request: HttpRequest, exc: Exception) -> HttpResponse:
    return _error(request, 404, "no such model", "NotFoundError")


@api.exception_handler(ValidationError)
def _invalid(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    unknown = [_field(e) for e in exc.errors if e.get("type") == "extra_forbidden"]
    if unknown:
        names = ", ".join(f"`{name}`" for name in unknown)
        message = f"unknown field{'s' if len(unknown) > 1 else ''} {names}: nothing was changed"
        return _error(request, 422, message, "UnknownFieldError")
    details = "; ".join(f"{_field(e)}: {e.get('msg')}" for e in exc.errors)
    return _error(request, 422, f"invalid request: {details}", "ValidationError")


def _field(error: dict[str, Any]) -> str:
    """The field's path in the body (`steps.0.weight`), without ninja's body.payload."""
    loc = [str(p) for p in error.get("loc", ())]
    if loc[:1] == ["body"]:
        loc = loc[2:] if len(loc) > 2 else loc[1:]
    return ".".join(loc)


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return _error(request, 401, _auth_hint(request), "AuthenticationError")


def _auth_hint(request: HttpRequest) -> str:
    """Say which credential this endpoint takes, and whether the server has one at all."""
    agent_call = request.path.endswith(("/register", "/heartbeat", "/deregister"))
    setting = "CONTROLPANEL_WORKER_TOKEN" if agent_call else "CONTROLPANEL_ADMIN_TOKEN"
    if not getattr(settings, setting):
        if agent_call:
            return f"agent calls are disabled: the server has no {setting} set"
        return f"log in as staff (the server has no {setting} set for bearer access)"
    return f"missing or wrong credentials: send Authorization: Bearer ${setting}"


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    return _error(request, exc.status_code, str(exc), "HttpError")


@api.exception_handler(DatabaseError)
def _database_down(request: HttpRequest, exc: DatabaseError) -> HttpResponse:
    """The registry's database failed (down, out of connections, a lock): nothing was
    changed, and the caller may retry; the router keeps serving from its snapshot."""
    log.error("admin API %s %s: database error: %s", request.method, request.path, exc)
    response = _error(
        request, 503, "the control plane's database is unavailable; retry shortly", "DatabaseError"
    )
    response["Retry-After"] = "5"
    return response


@api.exception_handler(Exception)
def _unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
    """A bug: logged with its traceback, answered in the API's JSON error shape rather than
    Django's HTML page. A database error that surfaced wrapped (in ninja's response
    validation, from a lazy queryset or a resolver) is still the outage's 503."""
    if errors.database_failed(exc):
        return _database_down(request, exc)  # type: ignore[arg-type]
    log.exception("admin API %s %s failed", request.method, request.path)
    return _error(request, 500, "internal error; see the server log", "InternalServerError")


# Every method of one path lives in one router module: Django matches the first pattern.
api.add_router("", workers.router)
api.add_router("", served_models.router)
api.add_router("", agents.router)
api.add_router("", rollouts.router)
api.add_router("", keys.router)
api.add_router("", explain.router)
