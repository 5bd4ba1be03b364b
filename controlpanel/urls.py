"""The project's URL wiring: the console's pages, the API, Django admin. The router's /v1
paths never get here: controlpanel.asgi dispatches them ahead of Django."""

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path
from django.views.defaults import page_not_found

from controlpanel.api.site import api
from controlpanel.console import error_pages
from controlpanel.routers.exposition import control_plane_metrics
from routing.errors import error_payload

urlpatterns = [
    # The registry's state for Prometheus (rollouts, key usage); the routers' own is /metrics.
    path("metrics/control-plane", control_plane_metrics, name="control-plane-metrics"),
    path("", include("controlpanel.console.urls")),
    path("admin/", admin.site.urls),
    path("api/", api.urls),
]


def handler404(request: HttpRequest, exception: Exception) -> HttpResponse:
    """API clients get JSON in the OpenAI error shape, browsers the styled page."""
    if request.path.startswith("/api/"):
        return JsonResponse(error_payload(404, f"no route {request.path}"), status=404)
    return page_not_found(request, exception)


# A database outage is a 503 with Retry-After (JSON under /api/, a styled page elsewhere);
# any other uncaught error the styled 500 page.
handler500 = error_pages.server_error
