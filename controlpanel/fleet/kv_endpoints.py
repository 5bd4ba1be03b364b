"""A worker's KV cache events endpoints (vLLM's --kv-events-config `endpoint` and
`replay_endpoint`, as routers connect to them): validated here so a typo is a clear 422 at
the API, not a router retrying a socket that can never connect."""

from __future__ import annotations

import re

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
