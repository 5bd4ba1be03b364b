"""Outlier ejection: the rule on its own (routing.clients.ejection). Through the real router:
tests/e2e/test_ejection.py."""

from __future__ import annotations

from bench.common.workers import worker_view
from routing.clients.ejection import Ejector


def test_consecutive_failures_eject_and_a_success_forgives() -> None:
    ejector = Ejector(threshold=3, base_cooldown=5)
    for _ in range(2):
        ejector.failure(1, "reset", now=0)
    ejector.success(1)
    ejector.failure(1, "reset", now=0)
    assert not ejector.ejected_until
    ejector.failure(1, "reset", now=0)
    ejector.failure(1, "reset", now=0)
    assert ejector.ejected_until == {1: 5}
    assert [e.kind for e in ejector.take_events()] == ["ejected"]


def test_cool_down_doubles_on_repeats_and_resets_after_a_quiet_spell() -> None:
    ejector = Ejector(threshold=1, base_cooldown=5, max_cooldown=15, forgive_after=100)
    cooldowns = []
    now = 0.0
    for _ in range(4):
        ejector.failure(7, "500", now=now)
        cooldowns.append(ejector.ejected_until[7] - now)
        now = ejector.ejected_until[7]
        ejector.probed(7, healthy=True, detail="ok", now=now)
    assert cooldowns == [5, 10, 15, 15]
    ejector.failure(7, "500", now=now + 1000)
    assert ejector.ejected_until[7] - (now + 1000) == 5


def test_a_failed_probe_ejects_again_for_longer() -> None:
    ejector = Ejector(threshold=1, base_cooldown=2)
    ejector.failure(3, "refused", now=0)
    assert ejector.due_for_probe(now=1) == []
    assert ejector.due_for_probe(now=2) == [3]
    ejector.probed(3, healthy=False, detail="refused", now=2)
    assert ejector.ejected_until[3] == 6


def test_routable_leaves_out_the_ejected_unless_all_are() -> None:
    workers = (worker_view(1), worker_view(2))
    ejector = Ejector(threshold=1)
    assert ejector.routable(workers) is workers
    ejector.failure(1, "x")
    assert [w.id for w in ejector.routable(workers)] == [2]
    ejector.failure(2, "x")
    assert ejector.routable(workers) is workers
