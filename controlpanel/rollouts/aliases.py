"""Aliases: public model names that stand for weighted targets.

The router draws a target by weight (routing.fleet.aliases); a rollout plan moves the weights
(controlpanel.rollouts.transitions), and nothing else may while one runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from django.db import transaction

from controlpanel.fleet.fallbacks import fallbacks_checked
from controlpanel.registry.choices import EventKind, RolloutState
from controlpanel.registry.errors import ServiceError
from controlpanel.registry.events import event_record
from controlpanel.registry.models import (
    ACTIVE_ROLLOUT_STATES,
    Alias,
    RolloutPlan,
    RoutingGeneration,
)

ALIAS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,299}$")


class InvalidAlias(ServiceError):
    status = 422


class AliasNotFound(ServiceError):
    status = 404


class AliasExists(ServiceError):
    status = 409


class AliasBusy(ServiceError):
    status = 409


def alias_targets_clean(targets: Any) -> dict[str, int]:
    if not isinstance(targets, dict) or not targets:
        raise InvalidAlias("targets must be a non-empty object of {model name: weight}")
    clean: dict[str, int] = {}
    for name, weight in targets.items():
        if not isinstance(name, str) or not name.strip():
            raise InvalidAlias("a target's model name must be a non-empty string")
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 10_000:
            raise InvalidAlias(f"the weight of `{name}` must be an integer from 0 to 10000")
        clean[name.strip()] = weight
    if not any(clean.values()):
        raise InvalidAlias("at least one target needs a weight above 0")
    return clean


def alias_create(
    *, name: str, targets: Any, description: str = "", fallbacks: Any = None, actor: str
) -> Alias:
    name = name.strip()
    if not ALIAS_NAME.match(name):
        raise InvalidAlias(
            "an alias name is 1-300 letters, digits or . _ : / @ + -, starting with a letter "
            "or digit"
        )
    clean = alias_targets_clean(targets)
    if name in clean:
        raise InvalidAlias("an alias cannot be its own target")
    with transaction.atomic():
        if Alias.objects.filter(name=name).exists():
            raise AliasExists(f"the alias `{name}` exists already")
        alias = Alias.objects.create(name=name, targets=clean, description=description)
        _alias_event(alias, f"created: {weights_text(clean)}", actor, before={})
        if fallbacks:  # checked once the alias exists, so a loop back to it is seen
            alias_set_fallbacks(alias, fallbacks, actor)
        RoutingGeneration.bump()
    return alias


def alias_update(
    *,
    name: str,
    targets: Any = None,
    description: str | None = None,
    fallbacks: Any = None,
    actor: str,
) -> Alias:
    with transaction.atomic():
        alias = alias_locked(name)
        if targets is not None:
            _refuse_during_rollout(alias, "change its weights")
            clean = alias_targets_clean(targets)
            if alias.name in clean:
                raise InvalidAlias("an alias cannot be its own target")
            set_weights(alias, clean, actor, f"weights set: {weights_text(clean)}")
        if description is not None and description != alias.description:
            before = {"description": alias.description}
            alias.description = description
            alias.save(update_fields=["description", "updated_at"])
            _alias_event(alias, "description changed", actor, before=before)
        if fallbacks is not None:  # a rollout moves weights only: fallbacks may change
            alias_set_fallbacks(alias, fallbacks, actor)
            RoutingGeneration.bump()
    return alias


def alias_set_fallbacks(alias: Alias, fallbacks: Any, actor: str) -> None:
    """The ordered names the alias's requests move on to (routing.fleet.fallbacks), checked as a
    model's are; the caller holds the alias's row and bumps the routing generation."""
    clean = fallbacks_checked(name=alias.name, fallbacks=fallbacks)
    before = {"fallbacks": list(alias.fallbacks)}
    alias.fallbacks = clean
    alias.save(update_fields=["fallbacks", "updated_at"])
    was, now = ", ".join(before["fallbacks"]) or "(none)", ", ".join(clean) or "(none)"
    _alias_event(alias, f"fallbacks {was} → {now}", actor, before=before)


def alias_delete(*, name: str, actor: str) -> None:
    with transaction.atomic():
        alias = alias_locked(name)
        _refuse_during_rollout(alias, "delete it")
        # Finished plans go with the alias; a scheduled one is the operator's to abort.
        waiting = (*ACTIVE_ROLLOUT_STATES, RolloutState.SCHEDULED)
        RolloutPlan.objects.filter(alias=alias).exclude(state__in=waiting).delete()
        if alias.rollouts.exists():
            raise AliasBusy(f"the alias `{name}` has a scheduled plan; abort it first")
        _alias_event(alias, "deleted", actor, before={"targets": alias.targets}, gone=True)
        alias.delete()
        RoutingGeneration.bump()


def alias_locked(name: str) -> Alias:
    try:
        return Alias.objects.select_for_update().get(name=name)
    except Alias.DoesNotExist:
        raise AliasNotFound(f"no alias `{name}`") from None


def _refuse_during_rollout(alias: Alias, what: str) -> None:
    plan = alias.rollouts.filter(state__in=ACTIVE_ROLLOUT_STATES).first()
    if plan is not None:
        raise AliasBusy(
            f"rollout #{plan.pk} is {plan.state} on `{alias.name}`: finish, abort or roll it "
            f"back before you {what}"
        )


def set_weights(alias: Alias, targets: dict[str, int], actor: str, message: str) -> None:
    before = {"targets": dict(alias.targets)}
    alias.targets = targets
    alias.save(update_fields=["targets", "updated_at"])
    _alias_event(alias, message, actor, before=before)
    RoutingGeneration.bump()


def _alias_event(
    alias: Alias, message: str, actor: str, *, before: dict[str, Any] | None = None,
    gone: bool = False,
) -> None:  # fmt: skip
    """`before`: the fields as they were (empty for a new alias); the event's `after` holds
    the same fields now (empty once deleted; a new alias's targets and description)."""
    data: dict[str, Any] = {"alias": alias.name, "targets": alias.targets}
    if before is not None:
        fields = before or {"targets": None, "description": None}
        data["before"] = before
        data["after"] = {} if gone else {f: getattr(alias, f) for f in fields}
    event_record(
        kind=EventKind.ALIAS_CHANGED,
        worker=None,
        message=f"alias {alias.name} {message}",
        actor=actor,
        data=data,
    )


def targets_in_order(targets: Mapping[str, int]) -> list[tuple[str, int]]:
    """Heaviest first, then by name: PostgreSQL's jsonb does not keep the keys' order."""
    return sorted(targets.items(), key=lambda item: (-item[1], item[0]))


def weights_text(targets: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {weight}" for name, weight in targets_in_order(targets))


def aliases_as_routes() -> dict[str, dict[str, int]]:
    """For the router's snapshot: {alias: {target: weight}}."""
    return {name: dict(targets) for name, targets in Alias.objects.values_list("name", "targets")}


def aliases_fallbacks() -> dict[str, list[str]]:
    """For the router's snapshot: {alias: its fallbacks}, aliases without any left out."""
    rows = Alias.objects.values_list("name", "fallbacks")
    return {name: list(fallbacks) for name, fallbacks in rows if fallbacks}
