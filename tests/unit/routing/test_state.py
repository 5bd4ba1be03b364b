"""What a router keeps between requests (routing.state): snapshots swapped in with their
policies resolved once, kept while their configuration holds, and what a swap tells the
ejector and the load board."""

from __future__ import annotations

import time

from bench.common.workers import worker_view
from routing.fleet.snapshot import ServedModelInfo, build_snapshot
from routing.state import RouterConfig, RouterState


def install(state: RouterState, /, policy: str = "round_robin", **worker_two: object) -> None:
    workers = [worker_view(1), worker_view(2, **worker_two)]
    served = [ServedModelInfo("m", policy=policy, max_inflight=0)]
    state.install(build_snapshot(workers=workers, served_models=served, generation=1))


def test_a_policy_lives_across_swaps_while_its_configuration_is_unchanged() -> None:
    state = RouterState()
    install(state)
    first = state.route_policies()["m"]
    install(state)
    assert state.route_policies()["m"] is first  # what it learned is kept
    install(state, policy="shortest_queue")
    assert state.route_policies()["m"].name == "shortest_queue"
    install(state)
    assert state.route_policies()["m"] is not first  # unused ones were dropped


def test_a_worker_the_control_plane_finds_healthy_again_is_readmitted() -> None:
    state = RouterState(RouterConfig(eject_after=1))
    install(state)
    state.ejector.failure(2, "reset")
    install(state, routable=False, state="unhealthy")  # the control plane takes it out
    assert 2 in state.ejector.ejected_until
    install(state)  # and back in: its probes answered
    assert 2 not in state.ejector.ejected_until


def test_the_workers_reported_queues_reach_the_loads_with_the_snapshot() -> None:
    state = RouterState()
    install(state, queue_length=4, queue_at=time.time())
    assert state.loads == {1: 0, 2: 4}
    assert state.metrics.worker_label(2) == "w2"


def test_admission_room_only_under_a_limit() -> None:
    free = RouterState()
    install(free)
    route = free.snapshot.routes["m"]
    assert free.admission_room(route, route.workers) is None
    limited = RouterState(RouterConfig(max_inflight_per_worker=1))
    install(limited)
    limited.board.started(1)
    assert limited.admission_room(route, route.workers) == {1: False, 2: True}


def test_recent_decisions_and_passive_failures_are_this_routers_without_peers() -> None:
    state = RouterState()
    state.decisions.add("m", "w1", "turn", 1, 200, None)
    assert [e["worker"] for e in state.recent_decisions()["m"]] == ["w1"]
    assert state.sync is None and state.store is None  # no REDIS_URL: nothing shared
    state.failures.passive[1] = (2, "connect: refused")
    assert state.passive_failures == {1: (2, "connect: refused")}
    assert state.take_passive_failures() == {1: (2, "connect: refused")}
    assert state.passive_failures == {}
