from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from controlpanel import services
from controlpanel.models import Event, RouterInstance, ServedModel, Worker


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin[Worker]):
    list_display = ("name", "url", "state", "source", "queue_length", "last_heartbeat")
    list_filter = ("state", "source")
    search_fields = ("name", "url")
    readonly_fields = (
        "models", "last_heartbeat", "queue_length", "created_at", "updated_at",
        "gpus", "gpus_source", "gpus_at", "gpu_warnings",
    )  # fmt: skip
    exclude = ("api_key",)  # set on the worker page or through the API; never shown back
    actions = ("drain", "activate")

    @admin.action(description="Drain the selected workers")
    def drain(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        for worker in queryset:
            services.worker_drain(worker_id=worker.pk, actor=f"admin:{request.user}")
        messages.success(request, f"drain started on {queryset.count()} worker(s)")

    @admin.action(description="Activate the selected workers")
    def activate(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        for worker in queryset:
            services.worker_activate(worker_id=worker.pk, actor=f"admin:{request.user}")
        messages.success(request, f"activated {queryset.count()} worker(s)")

    def delete_model(self, request: HttpRequest, obj: Worker) -> None:
        services.worker_remove(worker_id=obj.pk, actor=f"admin:{request.user}")

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        for worker in queryset:
            services.worker_remove(worker_id=worker.pk, actor=f"admin:{request.user}")

    def save_model(self, request: HttpRequest, obj: Worker, form: object, change: bool) -> None:
        super().save_model(request, obj, form, change)  # type: ignore[arg-type]
        services.routing_changed()


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin[ServedModel]):
    list_display = ("name", "policy", "updated_at")
    search_fields = ("name",)

    def save_model(
        self, request: HttpRequest, obj: ServedModel, form: object, change: bool
    ) -> None:
        super().save_model(request, obj, form, change)  # type: ignore[arg-type]
        services.routing_changed()


@admin.register(Event)
class EventAdmin(admin.ModelAdmin[Event]):
    list_display = ("created_at", "kind", "subject", "message", "actor")
    list_filter = ("kind",)
    search_fields = ("subject", "message")


@admin.register(RouterInstance)
class RouterInstanceAdmin(admin.ModelAdmin[RouterInstance]):
    list_display = ("instance_id", "hostname", "pid", "started_at", "last_seen")
