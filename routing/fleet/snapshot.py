"""An immutable, in-memory view of the fleet that the router reads on every request.

The refresher builds a new Snapshot off the request path and swaps the reference in one
assignment, so a request always sees one consistent fleet and never waits on a database.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import orjson

from routing.fleet import fallbacks
from routing.fleet.aliases import AliasRoute, alias_model_entry
from routing.fleet.client_keys import ClientKey


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One line of a worker's /v1/models; a LoRA adapter has its base model as parent."""

    id: str
    parent: str | None = None
    root: str | None = None
    max_model_len: int | None = None
    created: int | None = None


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU of a worker as last read (NVML or DCGM; see controlpanel.gpu), for /metrics.
    None: the source does not report it."""

    index: int
    uuid: str | None = None
    name: str | None = None
    util: float | None = None  # 0..1
    mem_used: float | None = None  # bytes
    mem_total: float | None = None  # bytes
    temp: float | None = None  # °C
    power: float | None = None  # W
    power_limit: float | None = None  # W
    ecc_errors: int | None = None
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerView:
    id: int
    name: str
    url: str
    state: str
    source: str
    models: tuple[ModelEntry, ...]
    # Requests the worker itself said it holds (vLLM's running + waiting), as last read, and
    # when (epoch seconds; None: unknown). The policies' load corrects it for what routers
    # sent since (routing.fleet.load_signal); displays show it as it was read.
    queue_length: int | None
    last_heartbeat: float | None  # epoch seconds
    routable: bool
    weight: float = 1.0
    # Scraped load signals (None: unknown), so policies can use them without I/O.
    running: int | None = None
    waiting: int | None = None
    kv_cache_usage: float | None = None
    prefix_hit_rate: float | None = None
    metrics_age: float | None = None  # seconds since the probe that read them, at build
    # Every scraped value by name (None: unknown), for /metrics and the dashboard.
    metrics: Mapping[str, Any] = field(default_factory=dict)
    # Fresh GPU readings only; empty when no source reports (unknown, never zeros).
    gpus: tuple[GpuView, ...] = ()
    # `Authorization` value for requests to this worker (its vLLM --api-key), or None.
    upstream_authorization: str | None = field(default=None, repr=False)
    queue_at: float | None = None  # when queue_length was read (epoch seconds)
    # Models whose pool keeps this worker out: it differs from the pool, the model says
    # "refuse", and no operator accepted the difference (controlpanel.fleet.preflight).
    refused_models: frozenset[str] = frozenset()
    # vLLM's KV cache events endpoints ("": none); every router subscribes off the request
    # path (routing.kv.kv_subscriber), and policies read the index it builds (routing.kv.kv_index).
    kv_events: str = ""
    kv_events_replay: str = ""
    # The engine's KV cache block size in tokens, from vllm:cache_config_info (None: not
    # reported yet). kv_aware reads a worker's size from its events first, this second, and
    # never assumes one (vLLM on CPUs uses 128, GPU backends 16 or more).
    kv_block_size: int | None = None
    # Prefill/decode disaggregation (routing.pd): "prefill" takes only the prefill leg of a
    # disaggregated model's requests, "decode" the decode leg (and bypasses), "both" (the
    # default) everything, as a colocated worker does.
    role: str = "both"

    def heartbeat_age(self, now: float) -> float | None:
        return None if self.last_heartbeat is None else max(0.0, now - self.last_heartbeat)


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """Everything the router needs to place a request for one model name."""

    name: str
    policy: str
    policy_config: Mapping[str, Any]
    workers: tuple[WorkerView, ...]  # routable workers only
    max_inflight: int = 0  # per router process; 0: no limit (routing.admission.admission)
    tokenizer: str = ""  # a local tokenizer folder for kv_aware (routing.prompt.tokenize); "": none
    priority_reserve: float = 0.2  # the slots share sheddable may never hold (admission)
    # Names to move on to, in the order tried, its fallbacks' own included
    # (routing.fleet.fallbacks).
    fallbacks: tuple[str, ...] = ()
    # Routable workers of role "prefill": with any, the model is disaggregated (routing.pd)
    # and `workers` holds the decode-capable ones (roles "decode" and "both").
    prefill: tuple[WorkerView, ...] = ()
    # A disaggregated model's request whose uncached prompt is shorter than this (tokens)
    # skips the prefill leg and goes straight to a decode-capable worker.
    pd_bypass_tokens: int = 256


@dataclass(frozen=True, slots=True)
class ServedModelInfo:
    name: str
    policy: str = "shortest_queue"
    policy_config: Mapping[str, Any] = field(default_factory=dict)
    max_inflight: int = 0
    tokenizer: str = ""
    priority_reserve: float = 0.2
    fallbacks: tuple[str, ...] = ()  # as configured (routing.fleet.fallbacks)
    pd_bypass_tokens: int = 256  # routing.pd's bypass threshold, for a disaggregated model


@dataclass(frozen=True, slots=True)
class Snapshot:
    generation: int
    built_at: float
    workers: tuple[WorkerView, ...]
    routes: Mapping[str, ModelRoute]
    # Pre-rendered at build time: /v1/models and /list_models cost nothing per request.
    models_payload: bytes
    list_models_payload: bytes
    model_entries: Mapping[str, dict[str, Any]]  # id -> its /v1/models entry
    # Public names standing for weighted targets (routing.fleet.aliases); an alias shadows a
    # model of the same name.
    aliases: Mapping[str, AliasRoute] = field(default_factory=dict)
    # Live client keys by their public prefix (routing.admission.auth); revoked ones are left out.
    api_keys: Mapping[str, ClientKey] = field(default_factory=dict)
    # When time alone (a heartbeat running out) may change who is routable; the refresher
    # rebuilds then even if no write announced anything.
    valid_until: float = float("inf")
    # The deployment's identity (the registry's); routers share state under it in Redis.
    deployment: str = ""

    @classmethod
    def empty(cls) -> Snapshot:
        return build_snapshot(workers=(), served_models=(), generation=-1)


def build_snapshot(
    *,
    workers: Iterable[WorkerView],
    served_models: Iterable[ServedModelInfo],
    generation: int,
    now: float | None = None,
    valid_until: float = float("inf"),
    aliases: Mapping[str, Mapping[str, int]] | None = None,
    api_keys: Iterable[ClientKey] = (),
    deployment: str = "",
    alias_fallbacks: Mapping[str, Sequence[str]] | None = None,
) -> Snapshot:
    workers = tuple(workers)
    configs = {m.name: m for m in served_models}
    serving: dict[str, list[WorkerView]] = {name: [] for name in configs}
    prefilling: dict[str, list[WorkerView]] = {}
    for worker in workers:
        for entry in worker.models:
            bucket = serving.setdefault(entry.id, [])
            if worker.role == "prefill":
                bucket = prefilling.setdefault(entry.id, [])
            if worker.routable and entry.id not in worker.refused_models:
                bucket.append(worker)
    routes = {
        name: ModelRoute(
            name=name,
            policy=configs[name].policy if name in configs else "shortest_queue",
            policy_config=MappingProxyType(dict(configs[name].policy_config))
            if name in configs
            else MappingProxyType({}),
            workers=tuple(bucket),
            max_inflight=configs[name].max_inflight if name in configs else 0,
            tokenizer=configs[name].tokenizer if name in configs else "",
            priority_reserve=configs[name].priority_reserve if name in configs else 0.2,
            prefill=tuple(prefilling.get(name, ())),
            pd_bypass_tokens=configs[name].pd_bypass_tokens if name in configs else 256,
        )
        for name, bucket in serving.items()
    }
    # An alias shadows a model of the same name, its fallbacks too.
    graph = {name: m.fallbacks for name, m in configs.items() if m.fallbacks}
    graph.update((name, tuple(f)) for name, f in (alias_fallbacks or {}).items() if f)
    fallback_chains = fallbacks.chains(graph, routes.keys() | (aliases or {}).keys())
    for name in routes.keys() & fallback_chains.keys():
        routes[name] = replace(routes[name], fallbacks=fallback_chains[name])
    serving_now = frozenset(name for name, route in routes.items() if route.workers)
    alias_routes = {
        name: AliasRoute.build(name, weights, serving_now, fallback_chains.get(name, ()))
        for name, weights in (aliases or {}).items()
    }
    routable_entries = _routable_model_entries(workers)
    entries = _model_list(routable_entries)
    entries = _with_aliases(entries, alias_routes, serving_now)
    return Snapshot(
        generation=generation,
        built_at=time.time() if now is None else now,
        workers=workers,
        routes=MappingProxyType(routes),
        models_payload=orjson.dumps({"object": "list", "data": entries}),
        list_models_payload=orjson.dumps({"models": [e["id"] for e in entries]}),
        model_entries=MappingProxyType({e["id"]: e for e in entries}),
        valid_until=valid_until,
        aliases=MappingProxyType(alias_routes),
        api_keys=MappingProxyType({k.prefix: k for k in api_keys}),
        deployment=deployment,
    )


def _with_aliases(
    entries: list[dict[str, Any]], aliases: Mapping[str, AliasRoute], serving: frozenset[str]
) -> list[dict[str, Any]]:
    """The model list with every alias that can serve now, in place of a same-named model."""
    by_id = {e["id"]: e for e in entries}
    now = int(time.time())
    for alias in aliases.values():
        if not any(target in serving for target, _ in alias.targets):
            by_id.pop(alias.name, None)
            continue
        lengths = [
            by_id[target]["max_model_len"]
            for target, _ in alias.live
            if target in by_id and by_id[target]["max_model_len"]
        ]
        by_id[alias.name] = alias_model_entry(alias, now, min(lengths, default=None))
    return sorted(by_id.values(), key=lambda e: str(e["id"]))


def _routable_model_entries(workers: tuple[WorkerView, ...]) -> list[ModelEntry]:
    seen: dict[str, ModelEntry] = {}
    for worker in workers:
        if worker.routable:
            for entry in worker.models:
                seen.setdefault(entry.id, entry)
    return list(seen.values())


def _model_list(entries: list[ModelEntry]) -> list[dict[str, Any]]:
    """vLLM's own /v1/models entries, so SDKs and tools see one big vLLM."""
    now = int(time.time())
    data: list[dict[str, Any]] = [
        {
            "id": e.id,
            "object": "model",
            "created": e.created or now,
            "owned_by": "vllm",
            "root": e.root or e.id,
            "parent": e.parent,
            "max_model_len": e.max_model_len,
            "permission": [],
        }
        for e in sorted(entries, key=lambda e: e.id)
    ]
    return data
