"""Admin endpoints for served models: their balancing policy and in-flight limit."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.db import transaction
from django.http import HttpRequest
from ninja import Field, Router, Schema
from ninja.errors import HttpError

from controlpanel.api.auth import ADMIN_AUTH
from controlpanel.api.limits import MAX_INT
from controlpanel.api.strict import StrictIn
from controlpanel.fleet import fallbacks, selectors, served_models
from controlpanel.registry.accounts import request_actor
from controlpanel.registry.models import ServedModel
from routing.policies import POLICIES

router = Router()


class ServedModelOut(Schema):
    name: str
    policy: str
    policy_config: dict[str, Any]
    max_inflight: int
    preflight: str  # "warn" or "refuse" (controlpanel.fleet.preflight)
    tokenizer: str  # kv_aware's local tokenizer folder; "": the workers' /tokenize
    # The slots share `sheddable` may never hold (routing.fleet.priority).
    priority_reserve: float
    fallbacks: list[str]  # names its requests move on to, in order (routing.fleet.fallbacks)
    # Disaggregated (it has prefill workers, routing.pd): shorter uncached prompts (tokens)
    # skip the prefill leg.
    pd_bypass_tokens: int
    workers: list[int]
    updated_at: datetime

    @staticmethod
    def resolve_workers(obj: ServedModel) -> list[int]:
        # Set by the endpoints from one query; a list of N models must not cost N scans.
        worker_ids: list[int] = getattr(obj, "worker_ids", [])
        return worker_ids


class ServedModelPatch(StrictIn):
    policy: str | None = None
    policy_config: dict[str, Any] | None = None
    # Requests in flight per router before new ones queue, then get 429; 0: no limit.
    max_inflight: int | None = Field(default=None, ge=0, le=1_000_000)
    # A worker unlike the rest of the pool is shown ("warn") or also kept out ("refuse").
    preflight: Literal["warn", "refuse"] | None = None
    # A local folder with tokenizer.json (and tokenizer_config.json) for kv_aware; "": none.
    tokenizer: str | None = Field(default=None, max_length=1024)
    # The share of admission slots kept from `sheddable` requests, in [0, 1).
    priority_reserve: float | None = None
    # Ordered model or alias names to move on to when this one cannot answer; []: none.
    fallbacks: list[str] | None = Field(default=None, max_length=64)
    # A disaggregated model's prompts shorter than this (uncached tokens) skip the prefill
    # leg and go whole to a decode-capable worker; 0: every request takes the prefill leg.
    pd_bypass_tokens: int | None = Field(default=None, ge=0, le=MAX_INT)


@router.get("/models", response=list[ServedModelOut], auth=ADMIN_AUTH, tags=["models"])
def models_list(request: HttpRequest) -> Any:
    return _with_workers(list(ServedModel.objects.all()))


def _with_workers(models: list[ServedModel]) -> list[ServedModel]:
    serving = selectors.workers_by_model()
    for model in models:
        model.worker_ids = serving.get(model.name, [])  # type: ignore[attr-defined]
    return models


@router.get("/models/{path:name}", response=ServedModelOut, auth=ADMIN_AUTH, tags=["models"])
def models_get(request: HttpRequest, name: str) -> Any:
    return _with_workers([ServedModel.objects.get(name=name)])[0]


@router.patch("/models/{path:name}", response=ServedModelOut, auth=ADMIN_AUTH, tags=["models"])
def models_set_policy(request: HttpRequest, name: str, payload: ServedModelPatch) -> Any:
    """Choose the balancing policy of one model (names: see GET /api/policies), its
    in-flight limit (`max_inflight`, 0: none), preflight mode, kv_aware's local
    `tokenizer` folder ("": none), its `fallbacks` (ordered model or alias names) and/or
    `pd_bypass_tokens` (a disaggregated model's shortest prompt taking the prefill leg)."""
    fields = (payload.policy, payload.max_inflight, payload.preflight, payload.tokenizer,
              payload.priority_reserve, payload.fallbacks, payload.pd_bypass_tokens)  # fmt: skip
    if all(value is None for value in fields):
        raise HttpError(
            422,
            "send `policy` (with `policy_config`), `max_inflight`, `preflight`, `tokenizer`, "
            "`priority_reserve`, `fallbacks` and/or `pd_bypass_tokens`",
        )
    model = ServedModel.objects.get(name=name)
    # One request, one outcome: a setting refused after others were set undoes them all.
    with transaction.atomic():
        if payload.fallbacks is not None:  # first too: a refused list changes nothing
            model = fallbacks.served_model_set_fallbacks(
                name=name, fallbacks=payload.fallbacks, actor=request_actor(request)
            )
        if payload.tokenizer is not None:  # first: a folder that cannot load changes nothing
            model = served_models.served_model_set_tokenizer(
                name=name, tokenizer=payload.tokenizer, actor=request_actor(request)
            )
        if payload.policy is not None:
            model = served_models.served_model_set_policy(
                name=name, policy=payload.policy, policy_config=payload.policy_config,
                actor=request_actor(request),
            )  # fmt: skip
        if payload.max_inflight is not None:
            model = served_models.served_model_set_limit(
                name=name, max_inflight=payload.max_inflight, actor=request_actor(request)
            )
        if payload.preflight is not None:
            model = served_models.served_model_set_preflight(
                name=name, mode=payload.preflight, actor=request_actor(request)
            )
        if payload.priority_reserve is not None:
            model = served_models.served_model_set_reserve(
                name=name, priority_reserve=payload.priority_reserve, actor=request_actor(request)
            )
        if payload.pd_bypass_tokens is not None:
            model = served_models.served_model_set_pd_bypass(
                name=name, pd_bypass_tokens=payload.pd_bypass_tokens, actor=request_actor(request)
            )
    return _with_workers([model])[0]


@router.get("/policies", response=list[str], auth=ADMIN_AUTH, tags=["models"])
def policies_list(request: HttpRequest) -> Any:
    return sorted(POLICIES)
