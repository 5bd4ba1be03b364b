"""The fused load signal (routing.fleet.load_signal): this router's requests, the other
routers', and the workers' own reports, each request counted once. The rule the policies
read is in routing.policies.load (tests/unit/routing/policies/)."""

from __future__ import annotations

from collections import defaultdict

from routing.fleet.load_signal import LoadBoard


def board(**kwargs: float) -> LoadBoard:
    return LoadBoard(defaultdict(int), **kwargs)


def test_own_requests_move_the_loads_at_once_between_refreshes() -> None:
    loads = board()
    loads.refresh(0.0, [1, 2])
    version = loads.loads.version
    loads.started(1)
    loads.started(1)
    loads.finished(1)
    loads.started(2)
    assert loads.loads == {1: 1, 2: 1}
    assert loads.loads.version == version  # the policies' hooks saw these themselves
    assert loads.describe(1) == {"load": 1, "inflight_here": 1, "inflight_elsewhere": 0}


def test_other_routers_requests_add_and_a_fall_moves_the_version() -> None:
    loads = board()
    loads.others = {1: 3}
    loads.refresh(0.0, [1])
    assert loads.loads == {1: 3}
    version = loads.loads.version
    loads.shift(1, 2)
    assert loads.loads[1] == 5 and loads.loads.version == version
    loads.shift(1, -4)
    assert loads.loads[1] == 1 and loads.loads.version == version + 1
    assert loads.describe(1)["inflight_elsewhere"] == 1


def test_a_report_adds_only_what_the_routers_had_not_sent_when_it_was_read() -> None:
    loads = board()
    for _ in range(2):
        loads.started(1)
    loads.refresh(10.0, [1])  # the fleet had 2 in flight on worker 1 from t=10
    loads.add_reports({1: (5, 10.5)})  # it then said 5: 3 the routers did not send
    loads.refresh(11.0, [1])
    assert loads.loads[1] == 2 + 3
    loads.finished(1)
    loads.finished(1)
    loads.refresh(12.0, [1])  # ours ended; the report still stands for its own 3
    assert loads.loads[1] == 3


def test_a_stale_report_is_dropped_and_an_older_never_replaces_a_newer() -> None:
    loads = board(report_max_age=5.0)
    loads.add_reports({1: (4, 100.0)})
    loads.add_reports({1: (9, 99.0)})
    assert loads.reports[1] == (4, 100.0)
    loads.refresh(101.0, [1])
    assert loads.loads[1] == 4
    loads.refresh(106.0, [1])  # six seconds old: back to the routers' counts
    assert loads.loads[1] == 0


def test_a_worker_gone_from_the_fleet_is_forgotten_unless_requests_still_run() -> None:
    loads = board()
    loads.started(2)
    loads.add_reports({1: (3, 0.0), 2: (3, 0.0)})
    loads.refresh(0.0, [1, 2])
    version = loads.loads.version
    loads.refresh(1.0, [])
    assert set(loads.loads) == {2} and loads.reports == {}
    assert loads.loads.version == version + 1
    loads.finished(2)
    loads.refresh(2.0, [2])  # back in the fleet: its load is recomputed, with no report
    assert loads.loads == {2: 0}
