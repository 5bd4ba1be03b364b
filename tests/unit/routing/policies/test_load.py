"""routing.policies.load: the least loaded worker, and the fused load every load-based policy reads
(the rule of that module, computed by routing.fleet.load_signal)."""

from __future__ import annotations

import random
from collections import defaultdict

from routing.fleet.load_signal import LoadBoard
from routing.policies.load import least_loaded, load_of
from tests.support.policy_views import (
    NO_INFLIGHT,
    fleet,
)


def test_least_loaded_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(300):
        workers = fleet(rng.randint(1, 30))
        loads = {w.id: rng.choice([0, 1, 2, 5]) + rng.randint(0, 4) for w in workers}
        loads = {k: v for k, v in loads.items() if v or rng.random() < 0.5}
        expected = min(workers, key=lambda w: load_of(w, loads))  # the first on a tie
        assert least_loaded(workers, loads) is expected
    assert least_loaded((), NO_INFLIGHT) is None


def test_a_reported_queue_counts_once_and_only_beyond_the_fleets_own_requests() -> None:
    """The fused load (routing.policies.load's rule, computed by routing.fleet.load_signal)."""
    own: defaultdict[int, int] = defaultdict(int)
    board = LoadBoard(own, report_max_age=10.0)
    board.refresh(100.0, [1, 2, 3])
    board.started(1)  # this router sends one request to worker 1 at t=100
    board.others = {1: 2, 3: 1}  # two more from other routers, one on worker 3
    board.refresh(100.5, [1, 2, 3])
    # Worker 1 reports 5 at t=101 (the 3 from routers + 2 from elsewhere); worker 2 reports 4
    # (no router's); worker 3 reports 1 (the other router's one request), then goes idle.
    board.add_reports({1: (5, 101.0), 2: (4, 101.0), 3: (1, 101.0)})
    board.refresh(101.5, [1, 2, 3])
    assert board.loads == {1: 5, 2: 4, 3: 1}
    board.others = {1: 2}  # worker 3's request ended: it is idle at once, report or not
    board.finished(1)  # and this router's own request on worker 1 ended
    board.refresh(102.0, [1, 2, 3])
    assert board.loads == {1: 4, 2: 4, 3: 0}
    assert board.loads.version > 0
    board.refresh(112.0, [1, 2, 3])  # reports stale: the routers' own counts only
    assert board.loads == {1: 2, 2: 0, 3: 0}
