"""A worker's load, the one rule every load-based policy uses, and config checking.

The load of a worker
--------------------
Every load-based policy (shortest_queue, power_of_two, prefix_aware's guard and misses,
least_kv's fallback and tie-breaker, session_affinity's overload check) reads one number per
worker from the ``loads`` mapping the router passes it (routing.fleet.load_signal computes it):

    fleet    = requests in flight on the worker in every router of the deployment, now:
               this router's own count (exact, live) + the other routers' (shared through
               Redis: routing.peers.load_push's pushed changes, a few ms old, and
               routing.peers.fleet_sync's 50 ms tick behind them; none without Redis, or while
               Redis is down)
    reported = the worker's own count of requests it holds (vLLM's running + waiting), as
               its last probe or agent heartbeat read it, at time t
    load     = fleet + max(0, reported - fleet(t))    when the report is fresh
    load     = fleet                                   when it is stale or missing

``fleet(t)`` is the routers' count at the moment of the report (each router keeps a short
history of it), so the difference is the work the routers did not send, or that the worker
still holds after they stopped counting it (other clients, requests queued at the engine),
counted once, while every request a router sends or finishes moves the load at once. A
report is fresh for CONTROLPANEL_LOAD_REPORT_MAX_AGE seconds (two probe intervals and one
more second by default). Two faults of the old rule (router in flight + reported queue) are
gone: the routers' own requests are no longer counted twice, and a worker that went idle
after its last report no longer looks busy until the next one (its excess over the fleet's
count was zero then, and the fleet's count fell with it).

Given plain counts (tests, benchmarks), a policy treats them as loads: ``{worker id: n}``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from routing.fleet.snapshot import WorkerView


def load_of(worker: WorkerView, loads: Mapping[int, int]) -> int:
    """The worker's load (the rule above; unknown counts 0). `loads.get`, not `[]`: the
    router's mapping must not grow here."""
    return loads.get(worker.id, 0)


def least_loaded(workers: Sequence[WorkerView], loads: Mapping[int, int]) -> WorkerView | None:
    """The least loaded of `workers`; ties go to the earlier one, so the choice is
    deterministic. Stops at a worker with no load: nothing later can beat it."""
    best: WorkerView | None = None
    best_load = 0
    get = loads.get
    for worker in workers:
        load = get(worker.id, 0)
        if best is None or load < best_load:
            best, best_load = worker, load
            if not load:
                break
    return best


# --- configuration ------------------------------------------------------------------------


def check_keys(policy: str, config: Mapping[str, Any], known: Collection[str]) -> None:
    """Refuse unknown keys: a misspelt knob would otherwise be silently ignored, and the
    control plane builds the policy when the operator sets it, so the typo is refused then."""
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ValueError(
            f"{policy}: unknown config key(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known)) or '(none)'}"
        )


def number(
    policy: str,
    config: Mapping[str, Any],
    key: str,
    default: float,
    *,
    minimum: float,
    exclusive: bool = False,
) -> float:
    """A finite JSON number >= `minimum` (> with `exclusive`); booleans are refused, although
    Python counts them as ints, because `true` for a number is a mistake, not a 1."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{policy}: {key} must be a finite number, not {value!r}")
    if value < minimum or (exclusive and value == minimum):
        relation = ">" if exclusive else ">="
        raise ValueError(f"{policy}: {key} must be {relation} {minimum}, not {value!r}")
    return float(value)


def integer(policy: str, config: Mapping[str, Any], key: str, default: int, *, minimum: int) -> int:
    """A JSON integer >= `minimum` (2.0 is accepted as 2; 2.5 and booleans are refused)."""
    value = config.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{policy}: {key} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{policy}: {key} must be >= {minimum}, not {value!r}")
    return value


def no_config(policy: str, config: Mapping[str, Any]) -> None:
    """For policies without knobs: any key is a mistake worth reporting."""
    check_keys(policy, config, ())
