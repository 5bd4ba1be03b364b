"""A served model's fallbacks, and the check a model's and an alias's both go through.

The names a model's requests move on to when it has no routable worker or failed before its
first byte (routing.fleet.fallbacks has the rules and the order). A list is refused, changing
nothing, when the router could not honour it: a name no request can be routed by (neither a
served model, a worker's model nor an alias), the name itself, a duplicate, more than
routing.fleet.fallbacks.MAX_FALLBACKS, or a loop through the other names' fallbacks, a model's or
an alias's (controlpanel.rollouts.aliases calls `fallbacks_checked` too).
"""

from __future__ import annotations

from typing import Any

from controlpanel.fleet.errors import InvalidModelSetting
from controlpanel.fleet.served_models import served_model_change
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Alias, ServedModel, Worker
from routing.fleet import fallbacks as routing_fallbacks


def served_model_set_fallbacks(*, name: str, fallbacks: Any, actor: str) -> ServedModel:
    """The ordered model or alias names this model's requests move on to when it has no
    routable worker or failed before its first byte (routing.fleet.fallbacks); [] for none."""
    return served_model_change(
        name=name,
        values=lambda: {"fallbacks": fallbacks_checked(name=name, fallbacks=fallbacks)},
        kind=EventKind.MODEL_CHANGED,
        actor=actor,
        describe=lambda before, after: (
            f"{name}: fallbacks {_names(before['fallbacks'])} → {_names(after['fallbacks'])}"
        ),
        flat=False,
    )


def fallbacks_checked(*, name: str, fallbacks: Any) -> list[str]:
    """`fallbacks` as stored (names stripped), or InvalidModelSetting saying why not: an
    unknown name, the name itself, a duplicate, too many, or a loop through the other
    names' fallbacks (a model's or an alias's: the aliases' services call it too)."""
    if not isinstance(fallbacks, list) or not all(
        isinstance(t, str) and t.strip() for t in fallbacks
    ):
        raise InvalidModelSetting("fallbacks must be a list of model or alias names")
    clean = [t.strip() for t in fallbacks]
    why = routing_fallbacks.refusal(name, clean, known=fallback_names(), graph=fallback_graph())
    if why is not None:
        raise InvalidModelSetting(why)
    return clean


def fallback_graph() -> dict[str, list[str]]:
    """Every name's fallbacks now, as the router reads them: an alias's over a model's."""
    graph = {n: list(f) for n, f in ServedModel.objects.values_list("name", "fallbacks") if f}
    graph.update((n, list(f)) for n, f in Alias.objects.values_list("name", "fallbacks") if f)
    return graph


def fallback_names() -> set[str]:
    """Every name a request can be routed by: served models, workers' models, aliases."""
    names = set(ServedModel.objects.values_list("name", flat=True))
    names.update(Alias.objects.values_list("name", flat=True))
    for models in Worker.objects.values_list("models", flat=True):
        names.update(m["id"] for m in models or () if isinstance(m, dict) and "id" in m)
    return names


def _names(names: list[str]) -> str:
    return ", ".join(names) if names else "(none)"
