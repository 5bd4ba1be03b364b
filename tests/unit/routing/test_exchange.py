"""One request's exchange (routing.exchange): a move to a fallback model, and the first
byte told to the policy."""

from __future__ import annotations

import orjson

from bench.common.workers import worker_view
from routing.policies import make_policy
from routing.policies.base import RequestInfo
from tests.support.exchanges import exchange


def test_moving_on_records_the_hop_renames_the_body_and_forgets_the_worker() -> None:
    payload = {"model": "chat", "messages": [], "temperature": 0.5}
    body = b'{"model": "m-v2", "messages": [], "temperature": 0.50}'
    ex = exchange(None, model="m-v2", body=body, fallbacks=("m-v1", "m-v0"), hops=[],
                  fall_back_reason="no_worker", worker_id=3, explain={})  # fmt: skip
    counts: dict[tuple[str, str, str], int] = {}
    assert ex.move_on(payload, counts) == "m-v1"
    assert ex.hops == [{"from": "chat", "to": "m-v1", "reason": "no_worker"}]
    assert ex.fallbacks == ("m-v0",) and ex.fall_back_reason is None and ex.worker_id is None
    assert ex.body == b'{"model": "m-v1", "messages": [], "temperature": 0.50}'
    assert ex.explain == {"fallbacks": ex.hops}
    assert ex.rewriter is not None and ex.rewriter.alias == "chat"
    ex.model, ex.fall_back_reason = "m-v1", "status_503"
    assert ex.move_on(payload, counts) == "m-v0"
    assert ex.hops[-1] == {"from": "m-v1", "to": "m-v0", "reason": "status_503"}
    assert counts == {("chat", "m-v1", "no_worker"): 1, ("m-v1", "m-v0", "status_503"): 1}
    assert orjson.loads(ex.body)["model"] == "m-v0"


def test_the_first_byte_is_timed_and_told_to_the_policy() -> None:
    told = []

    class Listening(type(make_policy("round_robin", {}))):  # type: ignore[misc]
        def on_first_byte(self, worker: object, request: object) -> None:
            told.append(worker)

    ex = exchange(None)
    ex.policy, ex.worker, ex.request = Listening({}), worker_view(1), RequestInfo("m", {}, [])
    ex.got_first_byte(12.5)
    assert ex.first_byte == 12.5 and told == [ex.worker]
