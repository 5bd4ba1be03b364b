"""Small helpers the load-based policies share: a worker's load and config checking.

A worker's load is what shortest_queue uses too: the requests this router has in flight on
it plus the queue length the worker last reported, so a worker kept busy by another router
still looks busy. Only the in-flight part changes between snapshots, and it never goes below
zero, so a list ordered once per snapshot by reported queue length lets `least_loaded` stop
scanning as soon as no later worker can beat the best one found: on an idle fleet that is
the first worker, whatever the fleet's size; on a fleet where every worker has requests in
flight it is every worker, which is why big fleets ask a routing.policies.load_index
`LoadIndex` instead.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from routing.snapshot import WorkerView


def load_of(worker: WorkerView, inflight: Mapping[int, int]) -> int:
    """Router in-flight count plus the worker's reported queue length (unknown counts 0).
    `inflight.get`, not `[]`: the router's dict is a defaultdict and must not grow here."""
    return inflight.get(worker.id, 0) + (worker.queue_length or 0)


def by_queue_length(workers: Sequence[WorkerView]) -> tuple[WorkerView, ...]:
    """`workers` ordered by reported queue length (stable), for `least_loaded`; built once
    per snapshot, not per request."""
    return tuple(sorted(workers, key=lambda w: w.queue_length or 0))


def least_loaded(ordered: Sequence[WorkerView], inflight: Mapping[int, int]) -> WorkerView | None:
    """The least loaded of `ordered` (which must come from `by_queue_length`); ties go to the
    earlier one, so the choice is deterministic. Stops once a worker's queue length alone
    reaches the best load so far: in-flight counts cannot make any later worker lighter."""
    best: WorkerView | None = None
    best_load = 0
    for worker in ordered:
        queued = worker.queue_length or 0
        if best is not None and queued >= best_load:
            break
        load = inflight.get(worker.id, 0) + queued
        if best is None or load < best_load:
            best, best_load = worker, load
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
