"""Each model's recent decisions (routing.peers.decisions): the ring of one router and the
merge of several."""

from __future__ import annotations

from routing.peers.decisions import DecisionRing, merged


def test_the_ring_keeps_each_models_latest_decisions_and_moves_its_version() -> None:
    ring = DecisionRing(size=2)
    for attempts in (1, 2, 3):
        ring.add("m", "w1", "least_loaded", attempts, 200, None)
    ring.add("other", None, "no_worker", 0, 503, {"why": "none"})
    shown = ring.snapshot()
    assert [e["attempts"] for e in shown["m"]] == [2, 3]
    assert shown["other"][0] | {"at": 0} == {
        "at": 0, "worker": None, "decision": "no_worker", "attempts": 0, "status": 503,
        "explanation": {"why": "none"},
    }  # fmt: skip
    assert ring.version == 4


def test_several_routers_rings_merge_newest_first_and_bounded() -> None:
    mine = {"m": [{"at": 1.0, "worker": "a"}, {"at": 4.0, "worker": "a"}]}
    peer = {"m": [{"at": 3.0, "worker": "b"}], "n": [{"at": 2.0, "worker": "b"}]}
    out = merged([mine, peer], size=2)
    assert out == {
        "m": [{"at": 4.0, "worker": "a"}, {"at": 3.0, "worker": "b"}],
        "n": [{"at": 2.0, "worker": "b"}],
    }
    assert mine["m"][0] == {"at": 1.0, "worker": "a"}  # the inputs are left as they were
