"""The fleet page's banner: what needs an operator's attention now, worst first, from the
same rows the table shows (so banner and table never disagree) and the recent rollouts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone

from controlpanel.console.dashboard import ModelTotals, Row, model_totals
from controlpanel.registry.choices import RolloutState
from controlpanel.registry.models import RolloutPlan

ROLLBACK_NOTICE = timedelta(hours=6)


@dataclass(frozen=True)
class Problem:
    severity: str  # "bad" or "warn"
    text: str
    href: str


def fleet_problems(rows: list[Row]) -> list[Problem]:
    totals = model_totals(rows)
    found = _models_without_workers(totals) + _adapters_without_workers(rows, totals)
    for row in rows:
        found += _worker_problems(row)
    found += _rollbacks()
    return sorted(found, key=lambda p: p.severity != "bad")


def _models_without_workers(totals: list[ModelTotals]) -> list[Problem]:
    return [
        Problem("bad", f"{t.name}: no routable worker ({t.workers} registered); requests get 503",
                f"{reverse('models')}#model-{t.name}")
        for t in totals if not t.routable
    ]  # fmt: skip


def _adapters_without_workers(rows: list[Row], totals: list[ModelTotals]) -> list[Problem]:
    """LoRA adapters no routable worker serves while their base model still has one (when
    the base has none, its own line says it all): their requests get 503 all the same."""
    bases_up = {t.name for t in totals if t.routable}
    adapters: dict[str, tuple[str, int, int]] = {}  # name -> (base, registered, routable)
    for row in rows:
        for entry in row.worker.models:
            if entry.get("parent"):
                _, registered, up = adapters.get(entry["id"], ("", 0, 0))
                adapters[entry["id"]] = (entry["parent"], registered + 1, up + int(row.routable))
    return [
        Problem("bad", f"{name} (LoRA adapter of {base}): no routable worker ({registered} "
                "registered); requests for it get 503", f"{reverse('models')}#model-{base}")
        for name, (base, registered, up) in sorted(adapters.items())
        if not up and base in bases_up
    ]  # fmt: skip


def _worker_problems(row: Row) -> list[Problem]:
    w, href = row.worker, reverse("worker", args=[row.worker.pk])
    found: list[Problem] = []
    if w.state == "degraded":
        found.append(Problem("bad", f"{w.name} degraded: {w.degraded_reason}", href))
    elif w.state in ("unhealthy", "offline"):
        cause = w.last_error or "no heartbeat"
        found.append(Problem("bad", f"{w.name} {w.state}: {cause}", href))
    failing = _failing_traffic(row)
    if failing and w.state != "degraded":
        found.append(Problem("warn", f"{w.name}: {failing}", href))
    waiting = row.metrics.get("waiting")
    if waiting is not None and waiting >= settings.CONTROLPANEL_WARN_WAITING:
        found.append(Problem("warn", f"{w.name}: {waiting} requests waiting in vLLM's queue", href))
    for warning in w.gpu_warnings:
        found.append(Problem("warn", f"{w.name}: {warning['message']}", f"{href}#gpus"))
    return found


def _failing_traffic(row: Row) -> str:
    rate = row.metrics.get("error_rate")
    if rate is None or rate < settings.CONTROLPANEL_WARN_ERROR_RATE:
        return ""
    window = settings.CONTROLPANEL_DEGRADED_WINDOW
    requests = row.metrics.get("window_requests")
    return f"{rate:.0%} of {requests} requests failed in the last {window:g} s"


def _rollback_problem(plan: RolloutPlan) -> Problem:
    text = f"Rollout #{plan.pk} of {plan.alias.name} {plan.get_state_display()}: {plan.reason}"
    return Problem("bad", text, reverse("rollout", args=[plan.pk]))


def _rollbacks() -> list[Problem]:
    since = timezone.now() - ROLLBACK_NOTICE
    plans = RolloutPlan.objects.select_related("alias").filter(
        state__in=(RolloutState.ROLLING_BACK, RolloutState.ROLLED_BACK), updated_at__gte=since
    )
    return [_rollback_problem(plan) for plan in plans]


def render_problems(rows: list[Row]) -> str:
    return render_to_string("controlpanel/_problems.html", {"problems": fleet_problems(rows)})
