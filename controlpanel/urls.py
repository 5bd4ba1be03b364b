from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.views.defaults import page_not_found

from controlpanel import views
from controlpanel.api import api

urlpatterns = [
    path("", views.fleet, name="fleet"),
    path("workers/add", views.worker_add, name="worker-add"),
    path("workers/<int:worker_id>/", views.worker_detail, name="worker"),
    path("workers/<int:worker_id>/drain", views.worker_drain, name="worker-drain"),
    path("workers/<int:worker_id>/activate", views.worker_activate, name="worker-activate"),
    path("workers/<int:worker_id>/remove", views.worker_remove, name="worker-remove"),
    path("models/", views.models_page, name="models"),
    path("models/policy", views.model_policy, name="model-policy"),
    path("events/", views.events_page, name="events"),
    path("admin/", admin.site.urls),
    path("api/", api.urls),
]


def handler404(request: HttpRequest, exception: Exception) -> HttpResponse:
    """API clients get JSON in the OpenAI error shape, browsers the usual page."""
    if request.path.startswith("/api/"):
        return JsonResponse(
            {
                "error": {
                    "message": f"no route {request.path}",
                    "type": "NotFoundError",
                    "param": None,
                    "code": 404,
                }
            },
            status=404,
        )
    return page_not_found(request, exception)
