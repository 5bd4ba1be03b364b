"""Fallbacks: other models or aliases a request moves on to when its own cannot answer it.

An operator gives a served model or an alias an ordered list of fallback names
(`PATCH /api/models/{name}` or the alias API: ``{"fallbacks": ["llama-8b-backup"]}``).

When a request moves on:

* its model (or alias, as the client named it: the *primary*) has no routable worker, or
* its last try failed before any byte reached the client, after the retries on the
  primary's other workers (routing.proxy): the connection was refused or reset, no
  connection or no response head came in time, or the worker answered 429, 502 or 503, or
* the router's own admission refused it (routing.admission.admission: the primary's in-flight limits
  full and its queue full, or its wait for room timed out; reason ``saturated``). Not a
  `sheddable` request shed under load: shedding is what its class asks for, and moving it
  to another pool would only pass the flood on. Nor a key's own limits (rate, budget):
  those are the key's, whatever model it asks for.

Never after the first byte: once the response head went out, the answer is the client's,
whatever becomes of it. Never to a name the client's key may not use (`ClientKey.allows`):
those names are left out, so a key allowed none of them gets the primary's own error.

The order tried: the primary's fallbacks in order, and a fallback that has fallbacks of its
own brings them in right after itself (depth first), each name once and at most MAX_CHAIN
names, so "if B cannot, do what B would do" holds. The chain is worked out once per
snapshot (`chains`), so a request reads it as one attribute of its route (an empty tuple
for the many models without fallbacks). A fallback may be an alias: its target is drawn as
for any request naming it. An alias's own fallbacks apply to requests naming the alias; the
models behind it do not bring theirs (the operator configures the public name).

Like an alias, a fallback changes only the `model` field of the forwarded body
(routing.fleet.aliases.rewrite_request_model) and renames `model` back in the answer, streamed
chunks included (ModelNameRewriter), so the client sees the name it asked for.

The control plane refuses, with `refusal`, a configuration the router could not honour:
an unknown name, the name itself, a duplicate, more than MAX_FALLBACKS, or a loop through
other names' fallbacks (A -> B -> A); the router never loops anyway (each name once).

Each move is counted (`controlpanel_router_fallbacks_total{model,target,reason}`), written
in the access log (`fallbacks`: the hops) and listed in an X-Route-Explain explanation.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily

if TYPE_CHECKING:
    from routing.fleet.client_keys import ClientKey

MAX_FALLBACKS = 8  # configured per name
MAX_CHAIN = 8  # names one request may move on to, its fallbacks' own included
NO_WORKER = "no_worker"
SATURATED = "saturated"  # the primary's admission refused it (limits and queue full)
GONE = "gone"  # a name the snapshot no longer knows (it changed during the request)

Hop = dict[str, str]  # {"from": name, "to": name, "reason": why}


# --- the chain, once per snapshot ---------------------------------------------------------


def chains(
    graph: Mapping[str, Sequence[str]], known: Collection[str]
) -> dict[str, tuple[str, ...]]:
    """Each name's fallbacks in the order a request tries them (see the module's docstring),
    names the snapshot does not know left out; only names with fallbacks are listed."""
    return {name: chain_of(name, graph, known) for name, direct in graph.items() if direct}


def chain_of(
    name: str, graph: Mapping[str, Sequence[str]], known: Collection[str]
) -> tuple[str, ...]:
    order: list[str] = []
    seen = {name}
    stack = list(reversed(graph.get(name, ())))  # depth first, in the configured order
    while stack and len(order) < MAX_CHAIN:
        target = stack.pop()
        if target in seen:
            continue
        seen.add(target)
        if target in known:
            order.append(target)
        stack.extend(reversed(graph.get(target, ())))
    return tuple(order)


# --- the control plane's check --------------------------------------------------------------


def refusal(
    name: str,
    fallbacks: Sequence[str],
    *,
    known: Collection[str],
    graph: Mapping[str, Sequence[str]],
) -> str | None:
    """Why `name` may not have these fallbacks (None: it may). `known` holds every name a
    request can be routed by (served models, workers' models, aliases); `graph` every
    other name's fallbacks now."""
    if len(fallbacks) > MAX_FALLBACKS:
        return f"at most {MAX_FALLBACKS} fallbacks, not {len(fallbacks)}"
    if name in fallbacks:
        return f"`{name}` cannot fall back to itself"
    repeated = sorted({t for t in fallbacks if fallbacks.count(t) > 1})
    if repeated:
        return "a fallback is named twice: " + ", ".join(f"`{t}`" for t in repeated)
    unknown = [t for t in fallbacks if t not in known]
    if unknown:
        names = ", ".join(f"`{t}`" for t in unknown)
        return f"unknown fallback {names}: neither a served model, a worker's model nor an alias"
    loop = _loop_back(name, {**graph, name: fallbacks})
    if loop:
        return "fallbacks may not loop: " + " → ".join(loop)
    return None


def _loop_back(start: str, graph: Mapping[str, Sequence[str]]) -> list[str]:
    """A path of fallbacks from `start` back to itself, or [] when there is none."""
    paths = [[start, target] for target in reversed(graph.get(start, ()))]
    seen: set[str] = set()
    while paths:
        path = paths.pop()
        last = path[-1]
        if last == start:
            return path
        if last in seen:
            continue
        seen.add(last)
        paths.extend([*path, target] for target in reversed(graph.get(last, ())))
    return []


# --- on a request ---------------------------------------------------------------------------


def usable(chain: tuple[str, ...], client: ClientKey | None) -> tuple[str, ...]:
    """The chain without the names the client's key may not use."""
    if client is None or not client.models:
        return chain
    return tuple(target for target in chain if client.allows(target))


def fallbacks_family(counts: Mapping[tuple[str, str, str], int]) -> Iterator[CounterMetricFamily]:
    family = CounterMetricFamily(
        "controlpanel_router_fallbacks",
        "Requests moved on to a fallback model or alias, by the name they left, the fallback "
        "and why (no_worker, connect, reset, connect_timeout, timeout, status_429|502|503).",
        labels=["model", "target", "reason"],
    )
    for (model, target, reason), count in counts.items():
        family.add_metric([model, target, reason], count)
    yield family
