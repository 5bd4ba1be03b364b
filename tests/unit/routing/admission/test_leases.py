"""A router's leases on fleet-wide limits (routing.admission.leases), around one exchange with
Redis.

The end-to-end behaviour (two routers, real Redis) is in tests/e2e/test_many_routers.py; these
pin the bookkeeping of one exchange, where a slip admits over the limit or strands a queue.
"""

from __future__ import annotations

import asyncio

from bench.common.workers import worker_view
from routing.admission.admission import CRITICAL_RANK, SHEDDABLE_RANK, Admission, Ticket
from routing.admission.leases import LeaseAsk, Leases


def ask(key: str, *, inflight: int, limit: int = 4) -> LeaseAsk:
    return LeaseAsk(key, limit, inflight + 1, inflight, inflight)


def shared_with(granted: dict[str, int]) -> Leases:
    leases = Leases()
    leases.update([(ask(key, inflight=0), grant, grant) for key, grant in granted.items()])
    return leases


def test_while_the_script_runs_a_router_admits_no_more_than_it_said_it_runs() -> None:
    leases = shared_with({"worker:1": 3})
    leases.hold([ask("worker:1", inflight=1)])
    assert leases.worker_cap(1, 4) == 1  # the grant coming back may be 1: no more meanwhile


def test_a_grant_equal_to_the_old_lease_still_wakes_the_queue() -> None:
    """A request that arrived during the round trip queued behind the held lease."""
    leases = shared_with({"worker:1": 3})
    asks = [ask("worker:1", inflight=1)]
    leases.hold(asks)
    assert leases.update([(asks[0], 3, 3)]) == {"worker:1"}
    assert leases.worker_cap(1, 4) == 3


def test_a_smaller_grant_is_what_the_router_then_admits_against() -> None:
    leases = shared_with({"worker:1": 3})
    asks = [ask("worker:1", inflight=1)]
    leases.hold(asks)
    assert leases.update([(asks[0], 1, 1)]) == set()
    assert leases.worker_cap(1, 4) == 1


def test_an_unanswered_ask_leaves_the_lease_redis_still_records() -> None:
    leases = shared_with({"worker:1": 3, "worker:2": 2})
    asks = [ask("worker:1", inflight=0), ask("worker:2", inflight=0)]
    leases.hold(asks)
    leases.update([(asks[0], 1, 1)])  # w2's script call failed
    assert (leases.worker_cap(1, 4), leases.worker_cap(2, 4)) == (1, 2)


def test_without_redis_the_whole_limit_applies_locally() -> None:
    leases = shared_with({"worker:1": 3})
    leases.hold([ask("worker:1", inflight=0)])
    leases.fall_back()
    assert leases.worker_cap(1, 4) == 4
    assert leases.granted["worker:1"] == 3  # the held lease is back for when Redis returns


def test_the_critical_headroom_stays_usable_through_the_round_trip() -> None:
    """A router keeping 1 slot for critical requests says it runs 2 of its lease of 4; the
    script grants at least that, so the kept slot may be taken while it runs."""
    leases = shared_with({"worker:1": 4})
    asks = list(
        leases.asks(
            per_worker=4, worker_inflight={1: 1}, worker_queued={1: 5}, model_limits={},
            model_inflight={}, model_queued={}, keep=lambda key, lease: 1,
        )
    )  # fmt: skip
    assert (asks[0].inflight, asks[0].demand) == (2, 6)
    leases.hold(asks)
    assert leases.worker_cap(1, 4) == 2


def test_kept_headroom_never_exceeds_the_lease_held() -> None:
    leases = shared_with({"worker:1": 2})
    [held] = leases.asks(
        per_worker=4, worker_inflight={1: 2}, worker_queued={}, model_limits={},
        model_inflight={}, model_queued={}, keep=lambda key, lease: 3,
    )  # fmt: skip
    assert held.inflight == 2  # the lease is all in use: nothing more to keep


def test_a_router_asks_a_spare_slot_of_every_routable_worker_before_sending_there() -> None:
    asks = Leases().asks(
        per_worker=4, workers=[1, 2], worker_inflight={3: 1}, worker_queued={},
        model_limits={}, model_inflight={}, model_queued={},
    )  # fmt: skip
    by_key = {a.key: (a.ask, a.demand, a.inflight) for a in asks}
    assert by_key == {"worker:1": (1, 0, 0), "worker:2": (1, 0, 0), "worker:3": (2, 1, 1)}


def test_critical_requests_may_fill_the_record_the_others_only_the_grant() -> None:
    """A router over its share (grant 2) still has 4 recorded: 3 running and 1 kept for
    critical requests; only a critical request may take that kept slot."""
    leases = Leases()
    held = LeaseAsk("worker:1", 8, 9, 8, 4)
    leases.update([(held, 2, 4)])
    assert leases.worker_cap(1, 8) == 2
    assert leases.worker_cap(1, 8, critical=True) == 4


def test_shed_requests_count_as_demand_once() -> None:
    """A sheddable request never waits, so its router's lease ask must hear of it."""

    async def scenario() -> tuple[dict[str, int], dict[str, int]]:
        admission = Admission(per_worker=0)
        admission.leases.shared = True  # no lease yet: no room
        ticket = Ticket(rank=SHEDDABLE_RANK)
        pick = lambda ws: ws[0]  # noqa: E731
        assert await admission.acquire("m", (worker_view(1),), 1, pick, {}, ticket) is None
        return admission.wanted(), admission.wanted()

    first, second = asyncio.run(scenario())
    assert first == {"m": 1} and second == {}


def test_a_router_claims_first_the_critical_headroom_of_what_it_may_run() -> None:
    """Shares (routing.admission.leases) give a router its critical headroom before the weights
    split
    the rest: ceil(reserve x its slots), from its leases, while critical traffic is recent."""

    async def scenario() -> tuple[int, int]:
        admission = Admission(per_worker=4)
        admission.leases = shared_with({"worker:1": 2, "worker:2": 1})
        workers = (worker_view(1), worker_view(2))
        before = admission.critical_claim("m", 0.2, workers, 0)
        pick = lambda ws: ws[0]  # noqa: E731
        critical = Ticket(rank=CRITICAL_RANK)
        assert await admission.acquire("m", workers, None, pick, {}, critical) is not None
        return before, admission.critical_claim("m", 0.2, workers, 0)

    assert asyncio.run(scenario()) == (0, 1)  # none before critical traffic; ceil(0.2 x 3)
