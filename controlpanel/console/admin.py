from collections.abc import Callable
from typing import Any, TypeVar

from django.contrib import admin, messages
from django.db import models, transaction
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest

from controlpanel.fleet import fallbacks, served_models, services
from controlpanel.fleet.errors import InvalidModelSetting, InvalidPolicy, InvalidTokenizer
from controlpanel.registry import events
from controlpanel.registry.accounts import request_actor
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Event, RouterInstance, ServedModel, Worker

M = TypeVar("M", bound=models.Model)

# The login page and every admin page carry the product's name, not "Django administration".
admin.site.site_header = "vLLM Control Panel"
admin.site.site_title = "vLLM Control Panel"
admin.site.index_title = "Registry"
admin.site.site_url = "/"


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """The audit log and the routers' own reports: to read, never to edit or delete."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


def admin_actor(request: HttpRequest) -> str:
    return request_actor(request, surface="admin")


class AuditedAdmin(admin.ModelAdmin[M]):
    """Django admin's forms write rows themselves, past the services: each save writes the
    event the service would (the staff user as actor, the changed fields before → after,
    secrets masked) and tells the routers, in one transaction with the row."""

    added_kind: str = EventKind.MODEL_CHANGED
    changed_kind: str = EventKind.MODEL_CHANGED

    def audit_target(self, obj: M) -> tuple[Worker | None, str]:
        """The event's worker and the words that name the row in its message."""
        raise NotImplementedError

    def save_model(self, request: HttpRequest, obj: M, form: ModelForm[M], change: bool) -> None:
        fields = list(form.changed_data)
        with transaction.atomic():
            stored = type(obj)._default_manager.filter(pk=obj.pk).first() if change else None
            before = {f: getattr(stored, f) for f in fields} if stored is not None else {}
            super().save_model(request, obj, form, change)
            self._audit(request, obj, before, {f: getattr(obj, f) for f in fields}, change)
            events.routing_changed()

    def _audit(
        self, request: HttpRequest, obj: M, before: dict[str, Any], after: dict[str, Any],
        change: bool,
    ) -> None:  # fmt: skip
        worker, name = self.audit_target(obj)
        if not change:
            events.event_record(
                kind=self.added_kind,
                worker=worker,
                message=f"{name} added in Django admin",
                actor=admin_actor(request),
                data={"before": {}, "after": events.masked(after)},
            )
            return
        events.event_record_change(
            kind=self.changed_kind,
            worker=worker,
            before=before,
            after=after,
            what="" if worker else name,
            actor=admin_actor(request),
            data={"via": "Django admin"},
        )


@admin.register(Worker)
class WorkerAdmin(AuditedAdmin[Worker]):
    list_display = ("name", "url", "state", "role", "source", "queue_length", "last_heartbeat")
    list_filter = ("state", "role", "source")
    search_fields = ("name", "url")
    # State changes go through the actions (the services: events, drains that finish, the
    # routers told); what probes, routers and agents write is theirs, shown, never typed.
    readonly_fields = (
        "state", "models", "last_heartbeat", "queue_length", "queue_length_at",
        "drain_generation", "consecutive_failures", "consecutive_successes", "last_probe_at",
        "last_error", "degraded_reason", "sleeping", "metrics", "scrape_state", "source",
        "created_at", "updated_at", "gpus", "gpus_source", "gpus_at", "gpu_count_max",
        "gpu_warnings",
    )  # fmt: skip
    exclude = ("api_key",)  # set on the worker page or through the API; never shown back
    actions = ("drain", "activate")

    @admin.action(description="Drain the selected workers")
    def drain(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        for worker in queryset:
            services.worker_drain(
                worker_id=worker.pk, actor=request_actor(request, surface="admin")
            )
        messages.success(request, f"drain started on {queryset.count()} worker(s)")

    @admin.action(description="Activate the selected workers")
    def activate(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        for worker in queryset:
            services.worker_activate(
                worker_id=worker.pk, actor=request_actor(request, surface="admin")
            )
        messages.success(request, f"activated {queryset.count()} worker(s)")

    def delete_model(self, request: HttpRequest, obj: Worker) -> None:
        services.worker_remove(worker_id=obj.pk, actor=request_actor(request, surface="admin"))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        for worker in queryset:
            services.worker_remove(
                worker_id=worker.pk, actor=request_actor(request, surface="admin")
            )

    added_kind = EventKind.WORKER_JOINED
    changed_kind = EventKind.WORKER_CHANGED

    def audit_target(self, obj: Worker) -> tuple[Worker | None, str]:
        return obj, f"worker {obj.name}"


class ServedModelForm(ModelForm):  # type: ignore[type-arg]
    """The admin's form runs the checks the API and the models page run, so nothing the
    routers could not build gets saved here either."""

    class Meta:
        model = ServedModel
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean() or {}
        # (the fields a check reads, the first taking its error; the check)
        checks: list[tuple[tuple[str, ...], Callable[[], object]]] = [
            (("policy", "policy_config"), lambda: served_models.policy_checked(
                data.get("policy", ""), data.get("policy_config") or {})),
            (("tokenizer",), lambda: served_models.tokenizer_checked(
                data.get("tokenizer") or "")),
            (("priority_reserve",), lambda: served_models.reserve_checked(
                data.get("priority_reserve", 0.2))),
            (("fallbacks", "name"), lambda: fallbacks.fallbacks_checked(
                name=data.get("name", ""), fallbacks=data.get("fallbacks", []))),
        ]  # fmt: skip
        for fields, check in checks:
            if any(field in self.errors for field in fields):
                continue  # Django has said what is wrong with the value itself
            try:
                check()
            except (InvalidPolicy, InvalidTokenizer, InvalidModelSetting) as exc:
                self.add_error(fields[0], str(exc))
        return data


@admin.register(ServedModel)
class ServedModelAdmin(AuditedAdmin[ServedModel]):
    form = ServedModelForm
    list_display = ("name", "policy", "updated_at")
    search_fields = ("name",)

    def audit_target(self, obj: ServedModel) -> tuple[Worker | None, str]:
        return None, f"model {obj.name}"

    def delete_model(self, request: HttpRequest, obj: ServedModel) -> None:
        with transaction.atomic():
            self._deleted(request, obj)
            super().delete_model(request, obj)
            events.routing_changed()

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ServedModel]) -> None:
        with transaction.atomic():
            for model in queryset:
                self._deleted(request, model)
            super().delete_queryset(request, queryset)
            events.routing_changed()

    def _deleted(self, request: HttpRequest, obj: ServedModel) -> None:
        settings = {
            f.name: getattr(obj, f.name)
            for f in obj._meta.concrete_fields
            if f.name not in ("id", "created_at", "updated_at")
        }
        events.event_record(
            kind=EventKind.MODEL_CHANGED,
            worker=None,
            message=f"model {obj.name} deleted in Django admin",
            actor=admin_actor(request),
            data={"before": events.masked(settings), "after": {}},
        )


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "kind", "subject", "message", "actor")
    list_filter = ("kind", "actor")
    search_fields = ("subject", "message", "actor")


@admin.register(RouterInstance)
class RouterInstanceAdmin(ReadOnlyAdmin):
    list_display = ("instance_id", "hostname", "pid", "started_at", "last_seen")
