"""Requests pinned to the worker holding a response (routing.response_pinning): the holder
found on a real router state, the route narrowed to it, and the errors that name the
response and its worker when it cannot answer."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from bench.common.workers import worker_view
from routing.fleet.aliases import AliasRoute
from routing.fleet.snapshot import ModelEntry, build_snapshot
from routing.peers.response_affinity import Holder
from routing.policies import make_policy
from routing.policies.base import RequestInfo
from routing.response_pinning import (
    Gone,
    PinnedPolicy,
    alias_target,
    holder_state,
    pin_route,
    place_by_id,
)
from routing.state import RouterConfig, RouterState
from tests.support.exchanges import Client, exchange

HOLDER = Holder("resp_1", 2, "m", "memory")


def router(**worker_two: Any) -> RouterState:
    state = RouterState(RouterConfig())
    workers = [
        worker_view(1),
        worker_view(2, **worker_two),
        worker_view(3, models=(ModelEntry("n"),)),
    ]
    state.install(build_snapshot(workers=workers, served_models=(), generation=1))
    return state


def test_a_follow_up_goes_to_the_holder_and_no_fallback() -> None:
    state = router()
    ex = exchange(None, fallbacks=("other",))
    inner = make_policy("round_robin", {})
    pinned = pin_route(state, ex, state.snapshot.routes["m"], inner, HOLDER)
    assert not isinstance(pinned, Gone)
    route, policy = pinned
    assert [w.id for w in route.workers] == [2] and route.fallbacks == () and ex.fallbacks == ()
    request = RequestInfo("m", {}, [])
    choice = policy.select(state.snapshot.routes["m"].workers, request, {})
    assert (choice.worker.id, choice.decision) == (2, "previous_response")  # type: ignore[union-attr]
    told = policy.explain(state.snapshot.routes["m"].workers, request, {2: 4})
    assert told.candidates == [{"worker": "w2", "load": 4, **HOLDER.shown()}]


def test_a_holder_that_cannot_answer_is_named_with_why() -> None:
    def gone(state: RouterState, model: str | None = "m", holder: Holder = HOLDER) -> Any:
        route = state.snapshot.routes.get(model) if model else None
        found = holder_state(holder, state.snapshot, state.ejector, route)
        return (found.status, found.message, found.param) if isinstance(found, Gone) else found.id

    left = Holder("resp_1", 9, "m", "redis")
    assert gone(router(), holder=left)[:2] == (
        404, "Response 'resp_1' is held by worker #9, which has left the fleet: "
        "its stored responses are gone with it.",
    )  # fmt: skip
    draining = router(state="draining", routable=False)
    assert gone(draining)[0] == 404 and "draining" in gone(draining)[1]
    assert gone(draining, model=None) == 2  # a GET or cancel still reaches it
    ejected = router()
    ejected.ejector.eject_shared(2, 60)
    assert gone(ejected)[:1] == (503,) and "ejected after failures" in gone(ejected)[1]
    assert gone(router(), model="n") == (
        404, "Response 'resp_1' is held by worker `w2`, which does not serve `n` now: "
        "no other worker has its state.", "previous_response_id",
    )  # fmt: skip
    assert gone(router(), model=None) == 2


def test_a_follow_up_through_an_alias_stays_with_the_holding_target() -> None:
    alias = AliasRoute.build("chat", {"m": 1, "m-new": 9}, frozenset({"m", "m-new"}))
    assert alias_target(HOLDER, alias, "m-new") == "m"
    elsewhere = AliasRoute.build("chat", {"x": 1}, frozenset({"x"}))
    assert alias_target(HOLDER, elsewhere, "x") == "x"


def by_id(state: RouterState, method: str, path: str) -> tuple[Any, Client, Any]:
    client = Client()
    ex = exchange(client, (b"x-route-explain", b"1"), method=method, path=path,
                  request_id=b"r-1", explain_asked=True)  # fmt: skip
    return asyncio.run(place_by_id(state, ex)), client, ex


def test_a_get_or_cancel_by_id_is_placed_on_its_holder() -> None:
    state = router()
    state.responses.record("resp_1", 2, "m")
    worker, client, ex = by_id(state, "POST", "/v1/responses/resp_1/cancel")
    assert worker.id == 2 and client.sent == []
    assert (ex.model, ex.decision, ex.pinned_shown["found_in"]) == (
        "m",
        "previous_response",
        "memory",
    )
    assert ex.explain["worker"] == "w2" and ex.explain["policy"] == PinnedPolicy.name


def test_an_unknown_id_a_wrong_method_and_a_gone_holder_are_refused() -> None:
    state = router()
    worker, client, _ = by_id(state, "GET", "/v1/responses/resp_unknown")
    assert worker is None and client.status == 404
    assert (
        orjson.loads(client.body)["error"]["message"]
        == "Response with id 'resp_unknown' not found."
    )
    assert by_id(state, "DELETE", "/v1/responses/resp_1")[1].status == 405
    assert by_id(state, "GET", "/v1/responses/a/b/c")[1].status == 404
    state.responses.record("resp_1", 2, "m")
    state.ejector.eject_shared(2, 60)
    _, client, _ = by_id(state, "GET", "/v1/responses/resp_1")
    assert client.status == 503 and (b"retry-after", b"2") in client.sent[0]["headers"]
