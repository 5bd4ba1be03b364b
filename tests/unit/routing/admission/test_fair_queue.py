"""The waiting room of one model (routing.admission.fair_queue) on its own: classes in
order, keys by weight, a key's sessions equally, a woken waiter keeping its place. Through
admission: test_priority.py beside it."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from routing.admission.fair_queue import FairQueue, Waiter

CRITICAL, STANDARD = 0, 1


def run(scenario: Callable[[FairQueue], Coroutine[Any, Any, Any]]) -> Any:
    async def main() -> Any:
        return await scenario(FairQueue())

    return asyncio.run(main())


def join(
    queue: FairQueue, rank: int = STANDARD, flow: int = 0, weight: float = 1.0,
    session: str | None = None,
) -> Waiter:  # fmt: skip
    return queue.join(rank, flow, weight, asyncio.get_running_loop().create_future(), session)


def woken(queue: FairQueue, waiters: list[Waiter]) -> Waiter:
    """Wake the next and take it as admitted, as routing.admission.admission does."""
    assert queue.wake()
    (waiter,) = [w for w in waiters if w.turn.done() and w.state == 1]
    queue.admitted(waiter)
    queue.leave(waiter)
    return waiter


def test_critical_waiters_are_woken_before_standard_ones_whatever_the_order() -> None:
    async def scenario(queue: FairQueue) -> list[int]:
        waiters = [join(queue, STANDARD), join(queue, CRITICAL), join(queue, STANDARD)]
        assert (len(queue), queue.waiting(CRITICAL), queue.waiting(STANDARD)) == (3, 1, 2)
        assert queue.waiting_at_or_above(CRITICAL) == 1
        assert queue.waiting_at_or_above(2) == 3  # sheddable would go after every waiter
        order = [waiters.index(woken(queue, waiters)) for _ in range(3)]
        assert not queue.wake() and len(queue) == 0
        return order

    assert run(scenario) == [1, 0, 2]


def test_a_keys_sessions_share_its_turns_equally_however_many_one_queues() -> None:
    async def scenario(queue: FairQueue) -> list[str | None]:
        waiters = [join(queue, flow=5, session="busy") for _ in range(6)]
        waiters += [join(queue, flow=5, session="calm") for _ in range(2)]
        waiters.append(join(queue, flow=5))  # the key's "no session" line
        return [woken(queue, waiters).session for _ in range(6)]

    assert run(scenario) == ["busy", "calm", None, "busy", "calm", "busy"]


def test_an_idle_key_starts_at_the_virtual_time_and_cannot_bank_turns() -> None:
    async def scenario(queue: FairQueue) -> list[int]:
        waiters = [join(queue, flow=1) for _ in range(4)]
        for _ in range(3):
            woken(queue, waiters)  # flow 1 alone: the virtual time moves to its tags
        waiters += [join(queue, flow=2), join(queue, flow=2)]
        waiters += [join(queue, flow=1)]
        return [woken(queue, waiters).flow for _ in range(4)]

    # Flow 2 comes in level with flow 1's next turn, not ahead of all it had.
    assert run(scenario) == [1, 2, 1, 2]


def test_a_waiter_woken_too_early_rejoins_ahead_of_later_arrivals() -> None:
    async def scenario(queue: FairQueue) -> list[int]:
        first = join(queue, flow=1)
        waiters = [first, join(queue, flow=2), join(queue, flow=1)]
        assert queue.wake() and first.turn.done()
        # No room after all: back in with its own tags; waking did not move virtual time.
        queue.rejoin(first, asyncio.get_running_loop().create_future())
        waiters.append(join(queue, flow=3))
        return [waiters.index(woken(queue, waiters)) for _ in range(4)]

    assert run(scenario) == [0, 1, 3, 2]


def test_a_cancelled_or_departed_waiter_passes_its_turn_on() -> None:
    async def scenario(queue: FairQueue) -> tuple[int, int]:
        gone, cancelled, stays = join(queue, flow=1), join(queue, flow=2), join(queue, flow=3)
        queue.leave(gone)
        cancelled.turn.cancel()  # timed out, not yet left
        assert queue.wake() and stays.turn.done()
        queue.leave(cancelled)
        queue.leave(stays)
        return len(queue), queue.waiting(STANDARD)

    assert run(scenario) == (0, 0)


def test_waiting_weight_sums_the_flows_with_requests_waiting() -> None:
    async def scenario(queue: FairQueue) -> list[float]:
        a = [join(queue, flow=1, weight=3.0) for _ in range(2)]
        b = join(queue, flow=2, weight=1.0)
        weights = [queue.waiting_weight()]
        queue.leave(a[0])
        weights.append(queue.waiting_weight())  # flow 1 still waits: still counted once
        queue.leave(a[1])
        queue.leave(b)
        weights.append(queue.waiting_weight())
        return weights

    assert run(scenario) == [4.0, 4.0, 0.0]


def test_weights_hold_when_admission_wakes_the_next_head_after_each_admission() -> None:
    """The regression the module's docstring tells of: a wake that does not end in an
    admission must not move the virtual time, or a weight-3 key's share falls to 2/3."""

    async def scenario(queue: FairQueue) -> Counter[int]:
        loop = asyncio.get_running_loop()
        waiters: list[Waiter] = []
        for _ in range(4):  # closed loops: each key keeps four requests waiting
            waiters += [join(queue, flow=1, weight=3.0), join(queue, flow=2, weight=1.0)]
        admitted: Counter[int] = Counter()
        for _ in range(80):
            winner = woken(queue, waiters)
            admitted[winner.flow] += 1
            # Room left is passed on: the next head is woken, finds none, and goes back.
            if queue.wake():
                (early,) = [w for w in waiters if w.turn.done() and w.state == 1]
                queue.rejoin(early, loop.create_future())
            waiters.append(join(queue, flow=winner.flow, weight=3.0 if winner.flow == 1 else 1.0))
        return admitted

    assert run(scenario) == Counter({1: 60, 2: 20})
