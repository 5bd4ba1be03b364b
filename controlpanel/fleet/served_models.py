"""Served models and how each is balanced: its policy, its in-flight limit, and when a
disaggregated model's short prompts skip the prefill leg."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from typing import Any

from django.db import transaction

from controlpanel.fleet.errors import InvalidModelSetting, InvalidPolicy, InvalidTokenizer
from controlpanel.registry.choices import EventKind
from controlpanel.registry.events import event_record
from controlpanel.registry.models import RoutingGeneration, ServedModel
from routing.policies import UnknownPolicy, policy_class
from routing.prompt.tokenize import LocalTokenizer

# The column's bound (PostgreSQL's integer): past it the write would fail, not be refused.
MAX_PD_BYPASS_TOKENS = 2**31 - 1


def served_models_ensure(entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        ServedModel.objects.get_or_create(name=entry["id"])


def served_model_change(
    *,
    name: str,
    values: Callable[[], dict[str, Any]],
    kind: str,
    actor: str,
    describe: Callable[[dict[str, Any], dict[str, Any]], str],
    flat: bool = True,
) -> ServedModel:
    """Set some of a served model's fields, under its row lock, with one event (before ->
    after; with `flat` the new values also at the data's top level) and one routing bump:
    what every setting's service does. `values` runs under the lock (a check that reads
    other rows sees them as they are committed); `describe(before, after)` is the message."""
    with transaction.atomic():
        model = ServedModel.objects.select_for_update().get(name=name)
        after = values()
        before = {field: getattr(model, field) for field in after}
        for field, value in after.items():
            setattr(model, field, value)
        model.save(update_fields=[*after, "updated_at"])
        data = {"model": name, **(after if flat else {}), "before": before, "after": after}
        event_record(
            kind=kind, worker=None, message=describe(before, after), actor=actor, data=data
        )
        RoutingGeneration.bump()
    return model


def served_model_set_policy(
    *, name: str, policy: str, policy_config: dict[str, Any] | None, actor: str
) -> ServedModel:
    """Change how a model's requests are balanced; routers apply it on their next poll.
    The configuration is checked by building the policy here, so a typo is refused now
    rather than discovered by the router."""
    config = policy_config or {}
    policy_checked(policy, config)
    return served_model_change(
        name=name,
        values=lambda: {"policy": policy, "policy_config": config},
        kind=EventKind.POLICY_CHANGED,
        actor=actor,
        describe=lambda before, _: (
            f"{name}: {before['policy']} -> {policy} {config or ''}".rstrip()
        ),
    )


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
    return served_model_change(
        name=name,
        values=lambda: {"preflight": mode},
        kind=EventKind.POLICY_CHANGED,
        actor=actor,
        describe=lambda before, _: f"{name}: preflight {before['preflight']} -> {mode}",
    )


def served_model_set_tokenizer(*, name: str, tokenizer: str, actor: str) -> ServedModel:
    """Give kv_aware a local tokenizer folder for this model ("": none, the workers'
    /tokenize then). Checked by loading it here, as a router will, so a wrong path or a
    broken tokenizer.json is refused now; the folder must exist on the routers' machines
    too (routers that cannot load it say so on /metrics and use the workers' /tokenize)."""
    tokenizer = tokenizer_checked(tokenizer)
    return served_model_change(
        name=name,
        values=lambda: {"tokenizer": tokenizer},
        kind=EventKind.POLICY_CHANGED,
        actor=actor,
        describe=lambda before, _: (
            f"{name}: tokenizer {before['tokenizer'] or '(none)'} -> {tokenizer or '(none)'}"
        ),
    )


def served_model_set_limit(*, name: str, max_inflight: int, actor: str) -> ServedModel:
    """Cap the requests in flight for one model per router (0: no cap); beyond it requests
    wait in a bounded queue, then get 429 (routing.admission.admission)."""
    limit = f"at most {max_inflight} in flight per router" if max_inflight else "no limit"
    return served_model_change(
        name=name,
        values=lambda: {"max_inflight": max_inflight},
        kind=EventKind.POLICY_CHANGED,
        actor=actor,
        describe=lambda before, _: f"{name}: {limit} (was {before['max_inflight'] or 'no limit'})",
    )


def served_model_set_reserve(*, name: str, priority_reserve: float, actor: str) -> ServedModel:
    """The share of the model's admission slots that `sheddable` requests may never hold
    (routing.fleet.priority): kept for `critical` and `standard` under an in-flight limit."""
    reserve_checked(priority_reserve)
    return served_model_change(
        name=name,
        values=lambda: {"priority_reserve": priority_reserve},
        kind=EventKind.MODEL_CHANGED,
        actor=actor,
        describe=lambda before, _: (
            f"{name}: priority_reserve {before['priority_reserve']!r} → {priority_reserve!r}"
        ),
        flat=False,
    )


def served_model_set_pd_bypass(*, name: str, pd_bypass_tokens: int, actor: str) -> ServedModel:
    """For a disaggregated model (it has prefill workers, routing.pd): a request whose
    uncached prompt is shorter than `pd_bypass_tokens` tokens skips the prefill leg and goes
    whole to a decode-capable worker; 0 sends every request through a prefill worker."""
    if not 0 <= pd_bypass_tokens <= MAX_PD_BYPASS_TOKENS:
        raise InvalidModelSetting(
            f"pd_bypass_tokens must be at least 0 and at most {MAX_PD_BYPASS_TOKENS}"
        )
    return served_model_change(
        name=name,
        values=lambda: {"pd_bypass_tokens": pd_bypass_tokens},
        kind=EventKind.MODEL_CHANGED,
        actor=actor,
        describe=lambda before, _: (
            f"{name}: pd_bypass_tokens {before['pd_bypass_tokens']} → {pd_bypass_tokens}"
        ),
        flat=False,
    )


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
