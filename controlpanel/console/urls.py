"""The operator's pages (staff login); the project's urls include them at the root."""

from django.templatetags.static import static
from django.urls import path
from django.views.generic.base import RedirectView

from controlpanel.console import fallback_views, key_views, pool_views, rollout_views, views

urlpatterns = [
    path("", views.fleet, name="fleet"),
    # Browsers ask for it on every page whatever the <link> says.
    path(
        "favicon.ico", RedirectView.as_view(url=static("controlpanel/favicon.svg"), permanent=True)
    ),
    path("workers/add", views.worker_add, name="worker-add"),
    path("workers/bulk", views.workers_bulk, name="workers-bulk"),
    path("workers/<int:worker_id>/", views.worker_detail, name="worker"),
    path("workers/<int:worker_id>/drain", views.worker_drain, name="worker-drain"),
    path("workers/<int:worker_id>/activate", views.worker_activate, name="worker-activate"),
    path("workers/<int:worker_id>/remove", views.worker_remove, name="worker-remove"),
    path("workers/<int:worker_id>/gpus", views.worker_gpu_source, name="worker-gpu-source"),
    path("workers/<int:worker_id>/api-key", views.worker_api_key, name="worker-api-key"),
    path("workers/<int:worker_id>/kv-events", views.worker_kv_events, name="worker-kv-events"),
    path("models/", views.models_page, name="models"),
    path("models/policy", views.model_policy, name="model-policy"),
    path("models/fallbacks", fallback_views.fallbacks_save, name="model-fallbacks"),
    path("models/preflight", pool_views.model_preflight, name="model-preflight"),
    path(
        "workers/<int:worker_id>/preflight/accept",
        pool_views.worker_preflight_accept,
        name="worker-preflight-accept",
    ),
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
    path("keys/<int:key_id>/edit", key_views.key_update, name="key-update"),
    path("usage/", key_views.usage_page, name="usage"),
]
