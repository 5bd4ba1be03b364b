from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.views.defaults import page_not_found

from controlpanel import key_views, rollout_views, views
from controlpanel.api import api

urlpatterns = [
    path("", views.fleet, name="fleet"),
    path("workers/add", views.worker_add, name="worker-add"),
    path("workers/<int:worker_id>/", views.worker_detail, name="worker"),
    path("workers/<int:worker_id>/drain", views.worker_drain, name="worker-drain"),
    path("workers/<int:worker_id>/activate", views.worker_activate, name="worker-activate"),
    path("workers/<int:worker_id>/remove", views.worker_remove, name="worker-remove"),
    path("workers/<int:worker_id>/gpus", views.worker_gpu_source, name="worker-gpu-source"),
    path("workers/<int:worker_id>/api-key", views.worker_api_key, name="worker-api-key"),
    path("models/", views.models_page, name="models"),
    path("models/policy", views.model_policy, name="model-policy"),
    path("events/", views.events_page, name="events"),
    path("rollouts/", rollout_views.rollouts_page, name="rollouts"),
    path("rollouts/new", rollout_views.rollout_create, name="rollout-create"),
    path("rollouts/<int:plan_id>/", rollout_views.rollout_detail, name="rollout"),
    path(
        "rollouts/<int:plan_id>/<str:action>", rollout_views.rollout_action, name="rollout-action"
    ),
    path("aliases/save", rollout_views.alias_save, name="alias-save"),
    path("aliases/delete", rollout_views.alias_delete, name="alias-delete"),
    path("keys/", key_views.keys_page, name="keys"),
    path("keys/new", key_views.key_create, name="key-create"),
    path("keys/<int:key_id>/revoke", key_views.key_revoke, name="key-revoke"),
    path("usage/", key_views.usage_page, name="usage"),
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
