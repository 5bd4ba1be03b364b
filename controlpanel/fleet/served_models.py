"""Served models and how each is balanced: its policy and its in-flight limit."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from django.db import transaction

from controlpanel.fleet.errors import InvalidModelSetting, InvalidPolicy, InvalidTokenizer
from controlpanel.registry.events import event_record
from controlpanel.registry.models import EventKind, RoutingGeneration, ServedModel
from routing.policies import UnknownPolicy, policy_class
from routing.tokenize import LocalTokenizer


def served_models_ensure(entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        ServedModel.objects.get_or_create(name=entry["id"])


def served_model_set_policy(
    *, name: str, policy: str, policy_config: dict[str, Any] | None, actor: str
) -> ServedModel:
    """Change how a model's requests are balanced; routers apply it on their next poll.
    The configuration is checked by building the policy here, so a typo is refused now
    rather than discovered by the router."""
    config = policy_config or {}
    policy_checked(policy, config)
    with transaction.atomic():
        model = ServedModel.objects.select_for_update().get(name=name)
        before = {"policy": model.policy, "policy_config": model.policy_config}
        previous = model.policy
        model.policy, model.policy_config = policy, config
        model.save(update_fields=["policy", "policy_config", "updated_at"])
        event_record(
            kind=EventKind.POLICY_CHANGED,
            worker=None,
            message=f"{name}: {previous} -> {policy} {config or ''}".rstrip(),
            actor=actor,
            data={"model": name, "policy": policy, "policy_config": config,
                  "before": before, "after": {"policy": policy, "policy_config": config}},
        )  # fmt: skip
        RoutingGeneration.bump()
    return model


def policy_checked(policy: str, config: dict[str, Any]) -> None:
    """InvalidPolicy unless the policy can be built with the configuration, as routers will."""
    try:
        policy_class(policy)(config)
    except (UnknownPolicy, ValueError, TypeError) as exc:
        raise InvalidPolicy(str(exc)) from exc


def tokenizer_checked(tokenizer: str) -> str:
    """The folder stripped, or InvalidTokenizer unless it loads here as a router loads it."""
    tokenizer = tokenizer.strip()
    if tokenizer:
        try:
            LocalTokenizer(tokenizer)
        except Exception as exc:  # tokenizers raises a bare Exception for a broken file
            raise InvalidTokenizer(f"tokenizer {tokenizer!r} cannot be used: {exc}") from exc
    return tokenizer


def reserve_checked(priority_reserve: float) -> None:
    if not 0.0 <= priority_reserve < 1.0:
        raise InvalidModelSetting("priority_reserve must be at least 0 and below 1")


def served_model_set_preflight(*, name: str, mode: str, actor: str) -> ServedModel:
    """ "warn": a worker unlike the rest of the pool is shown; "refuse": also kept out of the
    model's rotation until it matches or is accepted (controlpanel.fleet.preflight)."""
    if mode not in ("warn", "refuse"):
        raise InvalidPolicy(f'preflight is "warn" or "refuse", not {mode!r}')
    with transaction.atomic():
        model = ServedModel.objects.select_for_update().get(name=name)
        previous, model.preflight = model.preflight, mode
        model.save(update_fields=["preflight", "updated_at"])
        event_record(
            kind=EventKind.POLICY_CHANGED,
            worker=None,
            message=f"{name}: preflight {previous} -> {mode}",
            actor=actor,
            data={"model": name, "preflight": mode,
                  "before": {"preflight": previous}, "after": {"preflight": mode}},
        )  # fmt: skip
        RoutingGeneration.bump()
    return model


def served_model_set_tokenizer(*, name: str, tokenizer: str, actor: str) -> ServedModel:
    """Give kv_aware a local tokenizer folder for this model ("": none, the workers'
    /tokenize then). Checked by loading it here, as a router will, so a wrong path or a
    broken tokenizer.json is refused now; the folder must exist on the routers' machines
    too (routers that cannot load it say so on /metrics and use the workers' /tokenize)."""
    tokenizer = tokenizer_checked(tokenizer)
    with transaction.atomic():
        model = ServedModel.objects.select_for_update().get(name=name)
        previous, model.tokenizer = model.tokenizer, tokenizer
        model.save(update_fields=["tokenizer", "updated_at"])
        event_record(
            kind=EventKind.POLICY_CHANGED,
            worker=None,
            message=f"{name}: tokenizer {previous or '(none)'} -> {tokenizer or '(none)'}",
            actor=actor,
            data={"model": name, "tokenizer": tokenizer,
                  "before": {"tokenizer": previous}, "after": {"tokenizer": tokenizer}},
        )  # fmt: skip
        RoutingGeneration.bump()
    return model


def served_model_set_limit(*, name: str, max_inflight: int, actor: str) -> ServedModel:
    """Cap the requests in flight for one model per router (0: no cap); beyond it requests
    wait in a bounded queue, then get 429 (routing.admission)."""
    with transaction.atomic():
        model = ServedModel.objects.select_for_update().get(name=name)
        previous, model.max_inflight = model.max_inflight, max_inflight
        model.save(update_fields=["max_inflight", "updated_at"])
        limit = f"at most {max_inflight} in flight per router" if max_inflight else "no limit"
        event_record(
            kind=EventKind.POLICY_CHANGED,
            worker=None,
            message=f"{name}: {limit} (was {previous or 'no limit'})",
            actor=actor,
            data={"model": name, "max_inflight": max_inflight,
                  "before": {"max_inflight": previous}, "after": {"max_inflight": max_inflight}},
        )  # fmt: skip
        RoutingGeneration.bump()
    return model


def served_model_set_reserve(*, name: str, priority_reserve: float, actor: str) -> ServedModel:
    """The share of the model's admission slots that `sheddable` requests may never hold
    (routing.priority): kept for `critical` and `standard` under an in-flight limit."""
    reserve_checked(priority_reserve)
    with transaction.atomic():
        model = ServedModel.objects.select_for_update().get(name=name)
        before = model.priority_reserve
        model.priority_reserve = priority_reserve
        model.save(update_fields=["priority_reserve", "updated_at"])
        event_record(
            kind=EventKind.MODEL_CHANGED,
            worker=None,
            message=f"{name}: priority_reserve {before!r} → {priority_reserve!r}",
            actor=actor,
            data={"model": name, "before": {"priority_reserve": before},
                  "after": {"priority_reserve": priority_reserve}},
        )  # fmt: skip
        RoutingGeneration.bump()
    return model


_KNOB_DEFAULT = r"[`]{1,2}%s[`]{1,2}\s*\(([^)]*)\)"


def policy_knobs(name: str) -> dict[str, Any]:
    """A policy's configuration keys and their defaults, read from the policy itself: the
    keys its own validation accepts (it names them when refusing an unknown one), each
    default from its module's docstring. For the policy form's hint, never for routing."""
    cls = policy_class(name)
    try:
        cls({"\x00": 0})
        known: list[str] = []
    except (ValueError, TypeError) as exc:
        listed = str(exc).rpartition("known: ")[2]
        known = [] if listed.startswith("(none)") else [k.strip() for k in listed.split(",")]
    doc = sys.modules[cls.__module__].__doc__ or ""
    example: dict[str, Any] = {}
    for key in known:
        match = re.search(_KNOB_DEFAULT % re.escape(key), doc)
        default = re.search(r"default\s+([^,;)\s]+)", match.group(1)) if match else None
        example[key] = _json_value(default.group(1).strip('"`')) if default else None
    return {"keys": known, "example": json.dumps(example) if example else "{}"}


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
