"""A worker's KV cache events endpoints (vLLM's --kv-events-config `endpoint` and
`replay_endpoint`, as routers connect to them): validated here so a typo is a clear 422 at
the API, not a router retrying a socket that can never connect; and read from what the
worker itself says (vLLM's GET /kv_event_sources) when the operator gives none."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from controlpanel.registry.errors import ServiceError

MAX_ENDPOINT = 512
# A host name, an IPv4 address or a bracketed IPv6 address; never vLLM's bind wildcard `*`.
_TCP = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)"
                  r":(?P<port>[0-9]{1,5})")  # fmt: skip


class InvalidKvEventsEndpoint(ServiceError):
    status = 422


def kv_endpoint(value: str, *, field: str) -> str:
    """`value` stripped, "" for none; else tcp://host:port or ipc://path."""
    value = value.strip()
    if not value:
        return ""
    if len(value) > MAX_ENDPOINT:
        raise InvalidKvEventsEndpoint(f"{field} is at most {MAX_ENDPOINT} characters")
    if value.startswith("ipc://") and len(value) > len("ipc://") and value.isprintable():
        return value
    match = _TCP.fullmatch(value)
    if match and 0 < int(match["port"]) < 65536:
        return value
    raise InvalidKvEventsEndpoint(
        f"{field} must be tcp://host:port (port 1-65535, a host routers can reach, not *) "
        f"or ipc://path; got {value!r}"
    )


def kv_endpoints(kv_events: str, kv_events_replay: str) -> tuple[str, str]:
    """Both endpoints checked together: a replay endpoint serves a stream, so it needs one."""
    events = kv_endpoint(kv_events, field="kv_events")
    replay = kv_endpoint(kv_events_replay, field="kv_events_replay")
    if replay and not events:
        raise InvalidKvEventsEndpoint("kv_events_replay needs kv_events (the stream it replays)")
    return events, replay


def kv_endpoints_given(
    kv_events: str | None, kv_events_replay: str | None
) -> tuple[str | None, str | None]:
    """What an operator or agent gave, checked before anything is asked of the worker. A
    stream None (not given) is read from the worker, and so is a replay None beside it;
    "" keeps either off, and an endpoint given wins over the worker's."""
    if kv_events is not None:
        return kv_endpoints(kv_events, kv_events_replay or "")
    if kv_events_replay is None:
        return None, None
    return None, kv_endpoint(kv_events_replay, field="kv_events_replay")


# --- discovered from the worker: vLLM's GET /kv_event_sources -------------------------------

# Hosts on which vLLM's publisher binds every interface (its own test: "*" or "::" in the
# endpoint, 0.32 also 0.0.0.0): a router reaches them at the worker URL's host.
_ANY_HOST = frozenset({"*", "0.0.0.0", "::", ""})


@dataclass(frozen=True, slots=True)
class KvSources:
    """What a worker's /kv_event_sources gives the routers: its endpoints ("" for none) and
    a line for the worker's event saying where they came from, or why the events it
    publishes are not used ("" when it publishes none: nothing worth an operator's look)."""

    kv_events: str = ""
    kv_events_replay: str = ""
    note: str = ""


def kv_sources_from(payload: Any, *, worker_url: str) -> KvSources:
    """vLLM 0.32's answer, one KVEventsConfig per data-parallel rank, e.g.
    {"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558", ...}}, as endpoints routers can connect to.

    Only a zmq publisher with events on counts. Rank 0 is followed (the lowest rank if
    there is no "0"): a worker has one stream here, so other ranks are named in the note.
    A wildcard host becomes the worker URL's host, the port kept. A stream endpoint with a
    specific host is refused: vLLM *connects* its publisher there (it binds only on a
    wildcard), so there is nothing for a router to subscribe to. The replay socket is
    always bound, so its specific host is kept."""
    if not isinstance(payload, dict) or not payload:
        return KvSources()
    ranks = sorted(payload, key=_rank_order)
    rank, config = ranks[0], payload[ranks[0]]
    others = ""
    if ranks[1:]:
        listed = ", ".join(map(str, ranks[1:]))
        others = f" (data-parallel ranks {listed} publish too; routers follow rank {rank} only)"
    if not isinstance(config, dict) or config.get("enable_kv_cache_events") is not True:
        return KvSources()
    if config.get("publisher") != "zmq":
        return KvSources(
            note=f"the worker's KV events publisher is {config.get('publisher')!r}, not zmq"
        )
    host = urlsplit(worker_url).hostname or ""
    try:
        stream = _reachable(config.get("endpoint"), host, field="endpoint", bound=False)
    except InvalidKvEventsEndpoint as exc:
        return KvSources(note=f"KV events not used: {exc}{others}")
    if not stream:
        return KvSources(note=f"the worker's KV events have no endpoint{others}")
    try:  # a replay socket that cannot be used costs only the replay, not the stream
        replay = _reachable(config.get("replay_endpoint"), host, field="replay_endpoint",
                            bound=True)  # fmt: skip
        again = f" (replay {replay})" if replay else " (no replay endpoint)"
    except InvalidKvEventsEndpoint as exc:
        replay, again = "", f" (replay not used: {exc})"
    return KvSources(stream, replay, f"KV events discovered at {stream}{again}{others}")


def _rank_order(rank: Any) -> tuple[bool, int, str]:
    text = str(rank)
    return (not text.isdigit(), int(text) if text.isdigit() else 0, text)


def _reachable(value: Any, host: str, *, field: str, bound: bool) -> str:
    """One endpoint of the worker's config as routers reach it ("" for none)."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise InvalidKvEventsEndpoint(f"{field} is {value!r}, not a string")
    if not value.startswith("tcp://"):
        raise InvalidKvEventsEndpoint(
            f"{field} {value} is not a TCP endpoint, which routers on other machines need"
        )
    where, _, port = value.removeprefix("tcp://").rpartition(":")
    if where.strip("[]") in _ANY_HOST:
        where = f"[{host}]" if ":" in host else host
    elif not bound:
        raise InvalidKvEventsEndpoint(
            f"{field} {value} names a host, so vLLM connects out to it rather than listening"
        )
    return kv_endpoint(f"tcp://{where}:{port}", field=field)
