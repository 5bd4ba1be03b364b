"""The fused load signal: one number per worker that every load-based policy reads.

The rule is written out in routing.policies.load, where the policies use it. This module
keeps the numbers it needs and turns them into `LoadBoard.loads`, a plain dict the policies
read at C speed:

* `own`: this router's requests in flight per worker (the router's own live dict; +1 and -1
  on the request path, the only part that changes there);
* `others`: the other routers' in flight per worker, from routing.peers.fleet_sync's tick and,
  in between, routing.peers.load_push's pushed changes (`shift`); empty without Redis, or while
  Redis is down: the router then falls back to its own counts;
* `reports`: per worker, the queue it last reported (vLLM's running + waiting) and when;
* a short history of the fleet's in-flight count per worker, sampled each `refresh`, so a
  report can be corrected by what the routers sent since it was read.

`refresh` (about every 50 ms, off the request path) recomputes each worker's `base`, the load
not in `own`, and `loads[w] = own[w] + base[w]`; `started`/`finished` keep `loads` in step with
`own` in between. `loads.version` moves whenever a base changes, so a policy's cached index
(routing.policies.load_index) knows that loads may have fallen without its hooks seeing it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping

# How long a report stays usable: two probe intervals (5 s) and a second, so one late probe
# does not drop a worker back to the routers' counts.
DEFAULT_REPORT_MAX_AGE = 11.0


class LoadMap(dict[int, int]):
    """worker id -> load, as the policies read it; `version` moves when loads changed in a
    way the policies' hooks did not see (a refresh)."""

    version: int = 0


class LoadBoard:
    def __init__(
        self, own: defaultdict[int, int], *, report_max_age: float = DEFAULT_REPORT_MAX_AGE
    ) -> None:
        self.own = own
        self.loads = LoadMap()
        self.report_max_age = report_max_age
        self.others: dict[int, int] = {}
        self.reports: dict[int, tuple[int, float]] = {}
        self._base: dict[int, int] = {}
        # worker id -> (sample times, fleet in-flight at each); appended only on change.
        self._times: dict[int, deque[float]] = {}
        self._values: dict[int, deque[int]] = {}

    # -- the request path -----------------------------------------------------------------

    def started(self, worker_id: int) -> None:
        self.own[worker_id] += 1
        self.loads[worker_id] = self.loads.get(worker_id, 0) + 1

    def finished(self, worker_id: int) -> None:
        self.own[worker_id] -= 1
        self.loads[worker_id] = self.loads.get(worker_id, 0) - 1

    # -- off the path ---------------------------------------------------------------------

    def shift(self, worker_id: int, delta: int) -> None:
        """Another router's count on the worker moved by `delta` (routing.peers.load_push)."""
        self.others[worker_id] = self.others.get(worker_id, 0) + delta
        if worker_id in self._base:
            self._base[worker_id] += delta
            self.loads[worker_id] = self.loads.get(worker_id, 0) + delta
            if delta < 0:  # a rise is caught by the load index's live check; a fall is not
                self.loads.version += 1

    def add_reports(self, reports: Mapping[int, tuple[int, float]]) -> None:
        """Newer readings replace older ones; an older one (a snapshot built before the last
        poll) never replaces a newer."""
        for worker_id, (queue, at) in reports.items():
            known = self.reports.get(worker_id)
            if known is None or at > known[1]:
                self.reports[worker_id] = (queue, at)

    def refresh(self, now: float, worker_ids: Iterable[int]) -> None:
        """Sample the fleet's in-flight counts and recompute every worker's load."""
        changed = False
        seen: set[int] = set()
        for worker_id in worker_ids:
            seen.add(worker_id)
            fleet = self.own.get(worker_id, 0) + self.others.get(worker_id, 0)
            self._sample(worker_id, now, fleet)
            base = self._base_of(worker_id, now, fleet)
            if self._base.get(worker_id) != base:
                self._base[worker_id] = base
                changed = True
            self.loads[worker_id] = self.own.get(worker_id, 0) + base
        for gone in [w for w in self._base if w not in seen]:
            self._forget(gone)
            changed = True
        if changed:
            self.loads.version += 1

    def _base_of(self, worker_id: int, now: float, fleet: int) -> int:
        """The load not in `own`: the other routers' in flight, plus what the worker
        reported beyond the fleet's in-flight count at the moment it reported."""
        others = fleet - self.own.get(worker_id, 0)
        report = self.reports.get(worker_id)
        if report is None or now - report[1] > self.report_max_age:
            return others
        queue, at = report
        return others + max(0, queue - self._fleet_at(worker_id, at, fleet))

    def _sample(self, worker_id: int, now: float, fleet: int) -> None:
        times = self._times.get(worker_id)
        if times is None:
            self._times[worker_id], self._values[worker_id] = deque([now]), deque([fleet])
            return
        values = self._values[worker_id]
        if values[-1] != fleet:
            times.append(now)
            values.append(fleet)
        horizon = now - self.report_max_age
        while len(times) > 1 and times[1] <= horizon:  # keep the one sample before it
            times.popleft()
            values.popleft()

    def _fleet_at(self, worker_id: int, at: float, now_value: int) -> int:
        """The fleet's in-flight count on the worker at time `at`. Samples are a refresh
        apart, and the count may have moved between the one before `at` and the one after:
        the larger of the two is taken, so a request the routers had sent is never counted
        again as the worker's own (the rule's "counted once"); a request that had ended is
        then missing from the correction until the report after."""
        times = self._times.get(worker_id)
        if not times:
            return now_value
        values = self._values[worker_id]
        i = bisect_right(times, at)
        before = values[max(i - 1, 0)]
        after = values[i] if i < len(values) else now_value
        return max(before, after)

    def _forget(self, worker_id: int) -> None:
        self._base.pop(worker_id, None)
        self._times.pop(worker_id, None)
        self._values.pop(worker_id, None)
        self.reports.pop(worker_id, None)
        if not self.own.get(worker_id):
            self.loads.pop(worker_id, None)

    def describe(self, worker_id: int) -> dict[str, int | None]:
        """The parts of a worker's load, for /list_workers."""
        return {
            "load": self.loads.get(worker_id, self.own.get(worker_id, 0)),
            "inflight_here": self.own.get(worker_id, 0),
            "inflight_elsewhere": self.others.get(worker_id, 0),
        }
