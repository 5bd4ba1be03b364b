"""Routing explained (routing.telemetry.explain): who may ask, the dry run on a real
router state (nothing forwarded, nothing changed), and the header kept under its size."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from bench.common.workers import worker_view
from routing.fleet.client_keys import ClientKey
from routing.fleet.snapshot import ModelEntry, ServedModelInfo, build_snapshot
from routing.state import RouterConfig, RouterState
from routing.telemetry import explain

KEY = ClientKey(id=1, name="k", prefix="cpk_aaaaaaaa", digest=b"d")


def router(**config: int) -> RouterState:
    state = RouterState(RouterConfig(**config))  # type: ignore[arg-type]
    workers = [worker_view(1), worker_view(2), worker_view(3, models=(ModelEntry("other"),))]
    state.install(
        build_snapshot(
            workers=workers,
            served_models=[ServedModelInfo("m", policy="shortest_queue", max_inflight=0)],
            generation=1,
            aliases={"chat": {"m": 1}},
        )
    )
    return state


def test_who_may_ask_and_what_asking_looks_like() -> None:
    assert all(explain.wanted(v) for v in (b"1", b" true", b"YES"))
    assert not explain.wanted(b"0") and not explain.wanted(b"")
    assert explain.allowed(None, require_api_key=False)
    assert not explain.allowed(None, require_api_key=True)
    assert not explain.allowed(KEY, require_api_key=True)
    assert explain.allowed(ClientKey(1, "k", "p", b"d", explain=True), require_api_key=True)


def test_a_dry_run_explains_the_choice_and_changes_nothing() -> None:
    state = router()
    state.board.started(1)
    state.board.started(1)
    headers = [(b"x-session-id", b"agent-7")]
    shown = explain.dry_run(state, {"model": "chat", "messages": []}, headers)
    assert (shown["model"], shown["target"], shown["policy"]) == ("chat", "m", "shortest_queue")
    assert shown["worker"] == "w2" and shown["dry_run"] is True
    assert shown["candidates"] == [{"worker": "w2", "load": 0}, {"worker": "w1", "load": 2}]
    assert shown["session"] is not None and "agent-7" not in orjson.dumps(shown).decode()
    assert state.loads == {1: 2, 2: 0, 3: 0}  # nothing was placed
    assert state.route_policies()["m"].decisions == {}


def test_a_dry_run_shows_admission_room_under_a_limit() -> None:
    state = router(max_inflight_per_worker=1)
    state.board.started(1)
    shown = explain.dry_run(state, {"model": "m"}, [])
    assert {r["worker"]: r["admission"] for r in shown["candidates"]} == {
        "w1": "full", "w2": "room",
    }  # fmt: skip


def test_a_dry_run_needs_a_model_it_knows() -> None:
    state = router()
    with pytest.raises(ValueError, match="needs a `model`"):
        explain.dry_run(state, {"messages": []}, [])
    with pytest.raises(LookupError, match="`nope` does not exist"):
        explain.dry_run(state, {"model": "nope"}, [])


def test_the_header_drops_candidates_then_attempts_to_fit() -> None:
    base = {"model": "m", "policy": "p", "attempts": [{"worker": "w1"}]}
    rows = [{"worker": f"worker-{i}", "load": i, "note": "x" * 300} for i in range(30)]
    value = explain.encode({**base, "candidates": rows})
    shown = orjson.loads(value)
    assert len(value) <= explain.MAX_HEADER_BYTES and shown["truncated"] is True
    assert shown["candidates"] == rows[: len(shown["candidates"])]  # dropped from the end
    retried = {**base, "attempts": [{"try": i, "why": "y" * 500} for i in range(20)]}
    kept = orjson.loads(explain.encode(retried))["attempts"]
    assert [a["try"] for a in kept] == [17, 18, 19]  # the last tries, still JSON


def test_a_fallbacks_explanation_keeps_the_tries_before_it() -> None:
    before = {"attempts": [{"worker": "w1"}], "fallbacks": [{"from": "a", "to": "b"}],
              "prefill": {"worker": "p1"}}  # fmt: skip
    after = {"attempts": [{"worker": "w9"}]}
    explain.carry_over(before, after)
    assert after == {
        "attempts": [{"worker": "w1"}, {"worker": "w9"}],
        "fallbacks": [{"from": "a", "to": "b"}],
        "prefill": {"worker": "p1"},
    }


def test_another_thread_reads_the_router_on_its_own_loop() -> None:
    async def scenario() -> tuple[object, object]:
        state = router()
        explain.register_local(state)
        here = explain.on_router(lambda app: app.snapshot.generation)
        there = await asyncio.to_thread(explain.on_router, lambda app: len(app.snapshot.workers))
        return here, there

    assert asyncio.run(scenario()) == (1, 3)
    # The loop is closed now: no router serves this process any more.
    assert explain.on_router(lambda app: 1) is None
