"""Priority classes and fair share in admission control (routing.fleet.priority,
routing.admission.admission,
routing.admission.fair_queue): the rules, in process; tests/e2e/test_priority_e2e.py runs
them through a real router."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from bench.common.workers import worker_view
from routing.admission.admission import (
    CRITICAL_RANK,
    SHEDDABLE_RANK,
    STANDARD_RANK,
    Admission,
    Ticket,
)
from routing.admission.fair_queue import FairQueue
from routing.fleet.priority import UnknownClass, request_rank
from routing.fleet.snapshot import WorkerView

ONE = (worker_view(1),)


def first(candidates: object) -> WorkerView:
    return candidates[0]  # type: ignore[index,no-any-return]


def test_a_header_may_lower_the_class_never_raise_it_above_the_key() -> None:
    assert request_rank(None, None) == (STANDARD_RANK, False)  # the default
    assert request_rank(None, "critical") == (CRITICAL_RANK, False)  # the key's own class
    assert request_rank("sheddable", "critical") == (SHEDDABLE_RANK, False)  # lowered
    assert request_rank("critical", "standard") == (STANDARD_RANK, True)  # capped, counted
    assert request_rank(" Critical ", None) == (CRITICAL_RANK, False)  # keys off: it decides
    with pytest.raises(UnknownClass, match="unknown priority class 'urgent'"):
        request_rank("urgent", None)


class Pool:
    """One model's admission with the requests admitted so far, released one by one."""

    def __init__(self, admission: Admission, limit: int | None = None) -> None:
        self.admission, self.limit = admission, limit
        self.order: list[str] = []
        self.running: list[int] = []  # ranks of the admitted, oldest first

    async def ask(self, name: str, ticket: Ticket) -> WorkerView | None:
        worker = await self.admission.acquire("m", ONE, self.limit, first, {}, ticket)
        if worker is not None:
            self.order.append(name)
            self.running.append(ticket.rank)
        return worker

    async def release_one(self) -> None:
        self.admission.release("m", ["m"], self.running.pop(0))
        await asyncio.sleep(0.002)  # the woken waiter runs


def test_critical_goes_ahead_of_waiting_standard_and_sheddable_is_shed() -> None:
    async def scenario() -> tuple[list[str], Ticket]:
        pool = Pool(Admission(queue_timeout=5), limit=1)
        await pool.ask("running", Ticket())
        waiting = [asyncio.create_task(pool.ask(f"s{i}", Ticket())) for i in range(2)]
        await asyncio.sleep(0)
        waiting.append(asyncio.create_task(pool.ask("c", Ticket(rank=CRITICAL_RANK))))
        shed = Ticket(rank=SHEDDABLE_RANK)
        assert await pool.ask("x", shed) is None  # at once, not after a wait
        await asyncio.sleep(0)
        for _ in range(3):
            await pool.release_one()
        await asyncio.gather(*waiting)
        return pool.order, shed

    order, shed = asyncio.run(scenario())
    assert order == ["running", "c", "s0", "s1"]
    assert shed.refused == "shed"


def test_sheddable_never_takes_the_reserve_so_critical_gets_in_at_once() -> None:
    async def scenario() -> tuple[int, WorkerView | None, WorkerView | None]:
        admission = Admission(queue_timeout=5)
        pool = Pool(admission, limit=10)
        admitted = 0
        for i in range(12):  # a flood: 80 % of 10 slots, then shed
            admitted += await pool.ask(f"x{i}", Ticket(rank=SHEDDABLE_RANK)) is not None
        standard = await pool.ask("s", Ticket())  # no critical traffic yet: any free slot
        critical = await pool.ask("c", Ticket(rank=CRITICAL_RANK))
        return admitted, standard, critical

    admitted, standard, critical = asyncio.run(scenario())
    assert admitted == 8
    assert standard is not None and critical is not None  # both without waiting


def test_standard_leaves_the_reserve_only_while_critical_traffic_is_recent() -> None:
    async def fill(with_critical: bool) -> int:
        pool = Pool(Admission(queue_timeout=0.05), limit=10)
        if with_critical:
            await pool.ask("c", Ticket(rank=CRITICAL_RANK))
            await pool.release_one()
        admitted = 0
        for i in range(10):
            admitted += await pool.ask(f"s{i}", Ticket()) is not None
        return admitted

    assert asyncio.run(fill(with_critical=False)) == 10  # nobody needs the reserve: all slots
    assert asyncio.run(fill(with_critical=True)) == 8  # ceil(0.2 * 10) kept for critical


def test_no_reserve_means_no_headroom_rule() -> None:
    async def scenario() -> int:
        pool = Pool(Admission(queue_timeout=0.05), limit=4)
        admitted = 0
        for i in range(6):
            admitted += await pool.ask(f"x{i}", Ticket(rank=SHEDDABLE_RANK, reserve=0)) is not None
        return admitted

    assert asyncio.run(scenario()) == 4


def test_fair_queue_wakes_backlogged_flows_in_the_ratio_of_their_weights() -> None:
    async def scenario() -> Counter[int]:
        queue = FairQueue()
        loop = asyncio.get_running_loop()
        turns = {}
        for flow, weight, backlog in ((1, 1.0, 60), (2, 3.0, 60)):  # flow 1 queued first
            for _ in range(backlog):
                future: asyncio.Future[None] = loop.create_future()
                turns[future] = flow
                queue.join(STANDARD_RANK, flow, weight, future)
        woken: Counter[int] = Counter()
        for _ in range(40):
            assert queue.wake()
            done = next(f for f in turns if f.done() and not f.cancelled())
            woken[turns.pop(done)] += 1
        return woken

    woken = asyncio.run(scenario())
    assert woken == Counter({2: 30, 1: 10})


def test_three_keys_share_a_saturated_model_by_weight_however_hard_one_floods() -> None:
    """Weights 1, 1 and 2; key 1 queues five times what the others do, and first."""

    async def scenario() -> Counter[str]:
        pool = Pool(Admission(queue_timeout=30, queue_max=10_000), limit=4)
        for i in range(4):
            await pool.ask(f"warm{i}", Ticket(flow=9))
        tasks = [asyncio.create_task(pool.ask(f"k1-{i}", Ticket(flow=1))) for i in range(250)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(pool.ask(f"k2-{i}", Ticket(flow=2))) for i in range(50)]
        tasks += [
            asyncio.create_task(pool.ask(f"k3-{i}", Ticket(flow=3, weight=2))) for i in range(50)
        ]
        await asyncio.sleep(0)
        for _ in range(80):
            await pool.release_one()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return Counter(name.split("-")[0] for name in pool.order[4:])

    shares = asyncio.run(scenario())
    assert sum(shares.values()) == 80
    # 50 %, 25 %, 25 %, give or take the one turn that ties break
    assert abs(shares["k3"] - 40) <= 1 and abs(shares["k1"] - 20) <= 1
    assert abs(shares["k2"] - 20) <= 1


def test_a_waiter_that_leaves_gives_its_turn_to_the_next() -> None:
    async def scenario() -> list[str]:
        pool = Pool(Admission(queue_timeout=5), limit=1)
        await pool.ask("running", Ticket())
        leaver = asyncio.create_task(pool.ask("gone", Ticket(flow=1)))
        stayer = asyncio.create_task(pool.ask("stays", Ticket(flow=2)))
        await asyncio.sleep(0)
        leaver.cancel()
        await asyncio.sleep(0)
        await pool.release_one()
        await stayer
        return pool.order

    assert asyncio.run(scenario()) == ["running", "stays"]


def test_a_one_slot_model_still_serves_standard_while_critical_is_recent() -> None:
    async def scenario() -> list[str]:
        pool = Pool(Admission(queue_timeout=1), limit=1)
        await pool.ask("c", Ticket(rank=CRITICAL_RANK))
        waiting = asyncio.create_task(pool.ask("s", Ticket()))
        await asyncio.sleep(0)
        await pool.release_one()
        await waiting
        return pool.order

    assert asyncio.run(scenario()) == ["c", "s"]  # the reserve never takes the last slot


def test_standard_leaves_as_many_slots_as_critical_lately_ran_at_once() -> None:
    """With a reserve of 0.1 of 10 slots (one), after three critical requests ran together
    standard leaves three: a small lease's rounded reserve is not all critical needs."""

    async def scenario() -> int:
        pool = Pool(Admission(queue_timeout=0.05), limit=10)
        for i in range(3):
            await pool.ask(f"c{i}", Ticket(rank=CRITICAL_RANK, reserve=0.1))
        for _ in range(3):
            await pool.release_one()
        admitted = 0
        for i in range(10):
            admitted += await pool.ask(f"s{i}", Ticket(reserve=0.1)) is not None
        return admitted

    assert asyncio.run(scenario()) == 7
