"""The immutable fleet every request reads (routing.fleet.snapshot): which workers route
which model, the pre-rendered model lists, and what an operator configured."""

from __future__ import annotations

import orjson
import pytest

from bench.common.workers import worker_view
from routing.fleet.client_keys import ClientKey
from routing.fleet.snapshot import ModelEntry, ServedModelInfo, Snapshot, build_snapshot

LORA = ModelEntry("m-lora", parent="m", root="/adapters/m-lora", max_model_len=4096)


def test_only_routable_workers_that_do_not_refuse_a_model_route_it() -> None:
    snapshot = build_snapshot(
        workers=[
            worker_view(1, models=(ModelEntry("m"), LORA)),
            worker_view(2, routable=False),
            worker_view(3, refused_models=frozenset({"m"})),
        ],
        served_models=[ServedModelInfo("m", policy="prefix_aware", policy_config={"x": 1})],
        generation=7,
    )
    route = snapshot.routes["m"]
    assert [w.id for w in route.workers] == [1]
    assert (route.policy, dict(route.policy_config)) == ("prefix_aware", {"x": 1})
    assert [w.id for w in snapshot.routes["m-lora"].workers] == [1]
    assert snapshot.routes["m-lora"].policy == "shortest_queue"  # not configured: the default
    assert len(snapshot.workers) == 3  # every worker is shown, routable or not
    with pytest.raises(TypeError):
        snapshot.routes["m"].policy_config["x"] = 2  # type: ignore[index]


def test_a_configured_model_without_workers_has_an_empty_route_and_no_list_entry() -> None:
    snapshot = build_snapshot(
        workers=[worker_view(1)], served_models=[ServedModelInfo("idle")], generation=1
    )
    assert snapshot.routes["idle"].workers == ()
    assert orjson.loads(snapshot.list_models_payload) == {"models": ["m"]}


def test_the_model_list_is_vllms_own_rendered_once() -> None:
    snapshot = build_snapshot(
        workers=[worker_view(1, models=(ModelEntry("m", created=5), LORA))],
        served_models=(),
        generation=1,
    )
    payload = orjson.loads(snapshot.models_payload)
    assert payload["object"] == "list"
    assert [e["id"] for e in payload["data"]] == ["m", "m-lora"]
    lora = snapshot.model_entries["m-lora"]
    assert (lora["parent"], lora["root"], lora["max_model_len"]) == ("m", "/adapters/m-lora", 4096)
    assert (
        snapshot.model_entries["m"]["root"] == "m" and snapshot.model_entries["m"]["created"] == 5
    )


def test_prefill_workers_take_a_models_prefill_leg_only() -> None:
    snapshot = build_snapshot(
        workers=[worker_view(1, role="prefill"), worker_view(2, role="decode"), worker_view(3)],
        served_models=[ServedModelInfo("m", pd_bypass_tokens=64)],
        generation=1,
    )
    route = snapshot.routes["m"]
    assert [w.id for w in route.prefill] == [1]
    assert [w.id for w in route.workers] == [2, 3]
    assert route.pd_bypass_tokens == 64


def test_an_alias_shadows_a_model_and_lists_only_while_a_target_serves() -> None:
    workers = [worker_view(1, models=(ModelEntry("v1", max_model_len=8192),))]
    snapshot = build_snapshot(
        workers=workers,
        served_models=[ServedModelInfo("v1", fallbacks=("v2",)), ServedModelInfo("v2")],
        generation=1,
        aliases={"chat": {"v1": 1, "v2": 0}, "dark": {"v2": 1}},
        alias_fallbacks={"chat": ["v2"]},
    )
    assert set(snapshot.model_entries) == {"v1", "chat"}  # "dark" has no worker
    assert snapshot.model_entries["chat"]["max_model_len"] == 8192
    assert snapshot.aliases["chat"].fallbacks == ("v2",)
    assert snapshot.routes["v1"].fallbacks == ("v2",)
    assert snapshot.routes["v2"].fallbacks == ()


def test_live_keys_are_found_by_their_public_prefix() -> None:
    key = ClientKey(id=4, name="team", prefix="cpk_abcdefgh", digest=b"d")
    snapshot = build_snapshot(
        workers=(), served_models=(), generation=3, api_keys=[key], deployment="dep-1"
    )
    assert snapshot.api_keys == {"cpk_abcdefgh": key}
    assert (snapshot.generation, snapshot.deployment) == (3, "dep-1")


def test_the_empty_snapshot_routes_nothing_and_lists_nothing() -> None:
    empty = Snapshot.empty()
    assert empty.generation == -1 and not empty.routes and not empty.workers
    assert orjson.loads(empty.models_payload) == {"object": "list", "data": []}


def test_heartbeat_age_is_never_negative_and_unknown_without_one() -> None:
    assert worker_view(1).heartbeat_age(100.0) is None
    assert worker_view(1, last_heartbeat=90.0).heartbeat_age(100.0) == 10.0
    assert worker_view(1, last_heartbeat=110.0).heartbeat_age(100.0) == 0.0
