"""Fallbacks on the models page (staff only): each model's and alias's configured fallbacks,
and the form that sets them. Read here, act through the same services as the API
(controlpanel.fleet.fallbacks, controlpanel.rollouts.aliases)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from controlpanel.fleet import fallbacks
from controlpanel.registry.accounts import request_actor
from controlpanel.registry.errors import ServiceError
from controlpanel.registry.models import Alias, ServedModel
from controlpanel.rollouts import aliases
from controlpanel.routers.reports import fallback_counts

SESSION_KEY = "fallbacks_form"  # what was typed into a refused form, shown again


def parse_names(text: str) -> list[str]:
    """`a, b` or one name a line: the names in order; blank means none."""
    return [name.strip() for name in text.replace("\n", ",").split(",") if name.strip()]


def typed_form(request: HttpRequest) -> dict[str, str]:
    """The refused form's input, once (the page shows it in the form it came from)."""
    typed: dict[str, str] = request.session.pop(SESSION_KEY, {})
    return typed


def alias_rows(typed: dict[str, str]) -> list[dict[str, Any]]:
    """Every alias with its fallbacks, for the models page's aliases section."""
    moved = fallback_counts()
    return [
        {
            "name": alias.name,
            "targets": aliases.weights_text(alias.targets),
            "fallbacks": list(alias.fallbacks),
            "typed": _typed_for(typed, "alias", alias.name),
            "moved": _moved(moved.get(alias.name, {})),
        }
        for alias in Alias.objects.all()
    ]


def model_fallbacks(typed: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each served model's fallbacks, what was typed for it and the requests that moved on
    from it (every live router's count), by name."""
    moved = fallback_counts()
    return {
        name: {
            "fallbacks": list(names),
            "typed": _typed_for(typed, "model", name),
            "moved": _moved(moved.get(name, {})),
        }
        for name, names in ServedModel.objects.values_list("name", "fallbacks")
    }


def _moved(counts: dict[str, int]) -> list[tuple[str, int]]:
    return sorted(counts.items(), key=lambda item: -item[1])


def _typed_for(typed: dict[str, str], kind: str, name: str) -> str | None:
    return typed["fallbacks"] if typed.get("kind") == kind and typed.get("name") == name else None


@staff_member_required
@require_POST
def fallbacks_save(request: HttpRequest) -> HttpResponse:
    kind, name = request.POST.get("kind", ""), request.POST.get("name", "")
    text = request.POST.get("fallbacks", "")
    names, actor = parse_names(text), request_actor(request)
    try:
        if kind == "alias":
            aliases.alias_update(name=name, fallbacks=names, actor=actor)
        else:
            fallbacks.served_model_set_fallbacks(name=name, fallbacks=names, actor=actor)
    except ServiceError as exc:
        messages.error(request, f"Fallbacks of {name} not changed: {exc}")
        request.session[SESSION_KEY] = {"kind": kind, "name": name, "fallbacks": text}
    except ServedModel.DoesNotExist:
        messages.error(request, f"No model named {name}.")
    else:
        listed = ", ".join(names) if names else "none"
        messages.success(request, f"{name} now falls back to {listed}.")
    return redirect("models")
