"""Server-rendered pages for operators (staff only)."""

from __future__ import annotations

from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from controlpanel.models import Event, Worker


@staff_member_required
def fleet(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    expiry = settings.CONTROLPANEL_HEARTBEAT_EXPIRY
    rows = [
        {
            "worker": worker,
            "heartbeat_age": worker.heartbeat_age(now),
            "expired": worker.heartbeat_expired(expiry, now),
        }
        for worker in Worker.objects.all()
    ]
    context = {
        "rows": rows,
        "events": Event.objects.select_related("worker")[:20],
        "router_url": request.build_absolute_uri("/v1"),
    }
    return render(request, "controlpanel/fleet.html", context)
