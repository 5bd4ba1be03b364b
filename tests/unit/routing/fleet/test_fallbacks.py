"""routing.fleet.fallbacks on its own: the order a request tries, the control plane's refusals,
the key's limits, one move of an exchange, and the snapshot carrying the chains."""

from __future__ import annotations

from typing import Any

import orjson

from routing.exchange import Exchange
from routing.fleet import fallbacks
from routing.fleet.client_keys import ClientKey
from routing.fleet.snapshot import ModelEntry, ServedModelInfo, WorkerView, build_snapshot


def test_the_chain_is_depth_first_in_order_each_name_once() -> None:
    graph = {"a": ["b", "c"], "b": ["d", "a"], "c": ["b", "e"], "d": []}
    known = {"a", "b", "c", "d", "e"}
    assert fallbacks.chain_of("a", graph, known) == ("b", "d", "c", "e")
    assert fallbacks.chains(graph, known) == {
        "a": ("b", "d", "c", "e"),
        "b": ("d", "a", "c", "e"),
        "c": ("b", "d", "a", "e"),
    }


def test_the_chain_leaves_out_unknown_names_but_follows_them_and_is_capped() -> None:
    graph = {"a": ["gone", "x0"], "gone": ["b"]}
    assert fallbacks.chain_of("a", graph, {"a", "b", "x0"}) == ("b", "x0")
    wide = {"a": [f"x{i}" for i in range(20)]}
    chain = fallbacks.chain_of("a", wide, set(wide["a"]))
    assert chain == tuple(f"x{i}" for i in range(fallbacks.MAX_CHAIN))


def _refusal(name: str, names: list[str], graph: dict[str, list[str]] | None = None) -> str | None:
    known = {"a", "b", "c", "d", "alias-x"} | {f"m{i}" for i in range(20)}
    return fallbacks.refusal(name, names, known=known, graph=graph or {})


def test_refusals_name_what_is_wrong() -> None:
    assert _refusal("a", ["b", "c"]) is None
    assert _refusal("a", []) is None
    assert _refusal("a", ["a"]) == "`a` cannot fall back to itself"
    assert _refusal("a", ["b", "b", "c"]) == "a fallback is named twice: `b`"
    unknown = _refusal("a", ["b", "nope"])
    assert unknown is not None and "`nope`" in unknown and "neither a served model" in unknown
    many = _refusal("a", [f"m{i}" for i in range(fallbacks.MAX_FALLBACKS + 1)])
    assert many == f"at most {fallbacks.MAX_FALLBACKS} fallbacks, not 9"


def test_a_loop_through_other_names_is_refused_with_its_path() -> None:
    assert _refusal("a", ["b"], {"b": ["a"]}) == "fallbacks may not loop: a → b → a"
    assert _refusal("a", ["b"], {"b": ["c"], "c": ["alias-x"], "alias-x": ["a"]}) == (
        "fallbacks may not loop: a → b → c → alias-x → a"
    )
    # A name's old list is replaced by the new one, so breaking a loop is allowed.
    assert _refusal("a", ["c"], {"a": ["b"], "b": ["a"]}) is None
    # Two names sharing a fallback is no loop.
    assert _refusal("a", ["b", "c"], {"b": ["d"], "c": ["d"]}) is None


def _key(models: frozenset[str] = frozenset()) -> ClientKey:
    return ClientKey(id=1, name="k", prefix="cpk_abcdefgh", digest=b"", models=models)


def test_a_key_only_gets_the_names_it_may_use() -> None:
    chain = ("b", "c", "d")
    assert fallbacks.usable(chain, None) == chain
    assert fallbacks.usable(chain, _key()) == chain  # no list: every model
    assert fallbacks.usable(chain, _key(frozenset({"a", "c"}))) == ("c",)
    assert fallbacks.usable(chain, _key(frozenset({"a"}))) == ()


def _exchange(body: bytes) -> Exchange:
    async def nothing(*_: Any) -> Any:
        return None

    ex = Exchange({"type": "http", "headers": []}, nothing, nothing, 0.0)
    ex.body = body
    return ex


def test_one_move_rewrites_the_body_and_renames_the_answer_back() -> None:
    body = b'{"model": "a", "messages": [], "temperature": 0.50}'
    ex = _exchange(body)
    ex.model, ex.worker_id = "a", 7
    ex.fallbacks, ex.hops, ex.fall_back_reason = ("b", "c"), [], "status_503"
    counts: dict[tuple[str, str, str], int] = {}
    assert ex.move_on(orjson.loads(body), counts) == "b"
    assert ex.body == b'{"model": "b", "messages": [], "temperature": 0.50}'  # spliced only
    assert ex.fallbacks == ("c",) and ex.fall_back_reason is None
    assert ex.worker_id is None
    assert ex.hops == [{"from": "a", "to": "b", "reason": "status_503"}]
    assert counts == {("a", "b", "status_503"): 1}
    assert ex.rewriter is not None
    assert ex.rewriter.feed(b'data: {"id":"x","model":"b"}\n\n') == (
        b'data: {"id":"x","model":"a"}\n\n'
    )
    # A second move starts from the name the body has now, and names the hop after it.
    ex.model, ex.fall_back_reason = "b", "no_worker"
    assert ex.move_on(orjson.loads(body), counts) == "c"
    assert b'"model": "c"' in ex.body
    assert ex.hops[-1] == {"from": "b", "to": "c", "reason": "no_worker"}
    assert ex.rewriter.alias == "a"


def test_moves_are_listed_in_an_explanation() -> None:
    ex = _exchange(b'{"model":"a"}')
    ex.model, ex.explain = "a", {"attempts": [{"worker": "w", "moved_on": "connect"}]}
    ex.fallbacks, ex.hops, ex.fall_back_reason = ("b",), [], "connect"
    ex.move_on({"model": "a"}, {})
    assert ex.explain["fallbacks"] == [{"from": "a", "to": "b", "reason": "connect"}]


def _worker(wid: int, model: str) -> WorkerView:
    return WorkerView(
        id=wid, name=f"w{wid}", url=f"http://w{wid}", state="active", source="operator",
        models=(ModelEntry(model),), queue_length=0, last_heartbeat=None, routable=True,
    )  # fmt: skip


def test_the_snapshot_carries_each_name_s_chain() -> None:
    snapshot = build_snapshot(
        workers=[_worker(1, "b"), _worker(2, "c")],
        served_models=[
            ServedModelInfo("a", fallbacks=("chat", "gone")),
            ServedModelInfo("b"),
            ServedModelInfo("c", fallbacks=("b",)),
        ],
        aliases={"chat": {"c": 1}},
        alias_fallbacks={"chat": ["c", "b"]},
        generation=1,
    )
    assert snapshot.routes["a"].fallbacks == ("chat", "c", "b")  # "gone" is unknown here
    assert snapshot.routes["b"].fallbacks == ()
    assert snapshot.routes["c"].fallbacks == ("b",)
    assert snapshot.aliases["chat"].fallbacks == ("c", "b")
    assert snapshot.aliases["chat"].choose(None) == "c"  # the targets are as before


def test_families_count_each_move() -> None:
    (family,) = fallbacks.fallbacks_family({("a", "b", "no_worker"): 3})
    assert family.name == "controlpanel_router_fallbacks"
    (sample,) = [s for s in family.samples if s.name.endswith("_total")]
    assert sample.labels == {"model": "a", "target": "b", "reason": "no_worker"}
    assert sample.value == 3
