"""Discovery over HTTP: what a server says it serves, from vLLM's own /v1/models, and
where it publishes its KV cache events, from its GET /kv_event_sources."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.conf import settings

from controlpanel.fleet.errors import NotAVllmServer, RequestLoop, WorkerUnreachable
from controlpanel.fleet.kv_endpoints import KvSources, kv_endpoints, kv_sources_from
from controlpanel.fleet.probes import tls_context, worker_auth
from controlpanel.registry.models import RoutingGeneration, ServedModel
from routing.listings import DEPLOYMENT_HEADER

log = logging.getLogger(__name__)

MAX_MODEL_NAME = ServedModel._meta.get_field("name").max_length or 300


def discover_models(*, url: str, api_key: str = "") -> list[dict[str, Any]]:
    """Ask a server's /v1/models what it serves, refusing anything that is not vLLM-like."""
    import httpx  # here: the router process imports this module, and rarely discovers

    endpoint = f"{url}/v1/models"
    try:
        response = httpx.get(
            endpoint,
            headers=worker_auth(api_key),
            timeout=settings.CONTROLPANEL_DISCOVERY_TIMEOUT,
            verify=tls_context(),
        )
    except httpx.HTTPError as exc:
        raise WorkerUnreachable(f"cannot reach {endpoint}: {exc}") from exc
    refuse_request_loop(url, response.headers.get(DEPLOYMENT_HEADER.decode()))
    if response.status_code == 401:
        hint = "the worker's API key is wrong" if api_key else "set the worker's API key"
        raise NotAVllmServer(f"{endpoint} answered HTTP 401: {hint} (vLLM's --api-key)")
    if response.status_code != 200:
        raise NotAVllmServer(f"{endpoint} answered HTTP {response.status_code}, not a model list")
    try:
        return parse_model_list(response.json())
    except (ValueError, TypeError, KeyError) as exc:
        raise NotAVllmServer(f"{endpoint} did not return an OpenAI model list: {exc}") from exc


def discover_kv_events(*, url: str, api_key: str = "") -> KvSources:
    """The worker's KV events endpoints from vLLM's GET /kv_event_sources (0.32 and later).
    Never fails: an older vLLM (404) or an answer that is not JSON gives no endpoints
    quietly, a server that cannot be reached now gives none with a note, and the worker is
    added without them as before."""
    import httpx  # as in discover_models

    endpoint = f"{url}/kv_event_sources"
    try:
        response = httpx.get(
            endpoint,
            headers=worker_auth(api_key),
            timeout=settings.CONTROLPANEL_DISCOVERY_TIMEOUT,
            verify=tls_context(),
        )
    except httpx.HTTPError as exc:
        log.info("cannot read %s: %s", endpoint, exc)
        return KvSources(note=f"KV events not discovered: cannot reach {endpoint}")
    if response.status_code != 200:  # an older vLLM: no such route, and no events to use
        log.info("%s answered %s: no KV events discovered", endpoint, response.status_code)
        return KvSources()
    try:
        payload = response.json()
    except ValueError:
        log.info("%s did not answer JSON: no KV events discovered", endpoint)
        return KvSources()
    found = kv_sources_from(payload, worker_url=url)
    log.info("%s: %s", url, found.note or "the worker publishes no KV events")
    return found


def kv_endpoints_settled(
    given: tuple[str | None, str | None], *, url: str, api_key: str
) -> tuple[str, str, str]:
    """(stream, replay, a note for the worker's event) from what was given
    (kv_endpoints.kv_endpoints_given), the rest read from the worker."""
    stream, replay = given
    if stream is not None:
        return stream, replay or "", ""
    found = discover_kv_events(url=url, api_key=api_key)
    note = f"; {found.note}" if found.note else ""
    if replay is None:
        return found.kv_events, found.kv_events_replay, note
    # a replay endpoint given (or "" for none) wins; one given needs a stream to replay
    stream, replay = kv_endpoints(found.kv_events, replay)
    return stream, replay, note


def refuse_request_loop(url: str, deployment: str | None) -> None:
    """Every router of this deployment names it on its listings: a worker URL that answers
    with it reaches a router (this one, a sibling, or one behind a load balancer), and
    routing to it would send each request back in, in a loop. Host names prove nothing
    (127.0.0.1, a DNS alias, a VIP), the identity does. A router of another deployment is
    a legitimate upstream and passes."""
    if deployment and deployment == RoutingGeneration.deployment_id():
        raise RequestLoop(
            f"{url} is a router of this deployment, not a vLLM server: adding it would send "
            "requests in a loop; add the vLLM servers behind it instead"
        )


def parse_model_list(payload: Any) -> list[dict[str, Any]]:
    """Keep what routing needs from vLLM's list, in its order, one entry per id."""
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise ValueError("expected {'object': 'list', 'data': [...]}")
    seen: dict[str, dict[str, Any]] = {}
    for entry in payload["data"]:
        model_id = entry["id"]
        # Longer than the ServedModel column, the write would fail (PostgreSQL) later.
        if not isinstance(model_id, str) or not model_id or len(model_id) > MAX_MODEL_NAME:
            raise ValueError(f"bad model id {model_id!r}")
        seen.setdefault(model_id, _model_entry(entry))
    if not seen:
        raise ValueError("the server lists no model")
    return list(seen.values())


def _model_entry(entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": entry["id"],
        "parent": entry.get("parent"),
        "root": entry.get("root"),
        "max_model_len": entry.get("max_model_len"),
        "created": entry.get("created"),
    }


def model_keys(entries: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What identifies a model list; not `created`, which vLLM stamps with the current time
    on every /v1/models answer."""
    return [(e.get("id"), e.get("parent"), e.get("root"), e.get("max_model_len")) for e in entries]


def models_from_agent(names_or_entries: Iterable[Any]) -> list[dict[str, Any]]:
    """An agent may send bare names or vLLM entries; both become vLLM entries."""
    entries = [{"id": item} if isinstance(item, str) else dict(item) for item in names_or_entries]
    try:
        return parse_model_list({"data": entries})
    except (ValueError, TypeError, KeyError) as exc:
        raise NotAVllmServer(f"the agent's model list is not usable: {exc}") from exc
