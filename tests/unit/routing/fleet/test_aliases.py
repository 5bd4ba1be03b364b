"""Aliases in the router: target choice, the request rewrite and the streamed rename."""

from __future__ import annotations

from collections import Counter

import orjson
import pytest

from routing.fleet.aliases import AliasRoute, ModelNameRewriter, rewrite_request_model
from routing.fleet.snapshot import ModelEntry, WorkerView, build_snapshot


def test_weighted_draw_follows_the_weights() -> None:
    alias = AliasRoute.build("chat", {"v1": 90, "v2": 10}, frozenset({"v1", "v2"}))
    picks = Counter(alias.choose(None) for _ in range(20_000))
    share = picks["v2"] / 20_000
    assert 0.09 < share < 0.11  # 10% +- more than 4 sigma (sigma = 0.2%)


def test_zero_weights_and_targets_without_workers_take_no_traffic() -> None:
    alias = AliasRoute.build("chat", {"v1": 50, "v2": 50, "v3": 0}, frozenset({"v1", "v3"}))
    assert {alias.choose(None) for _ in range(500)} == {"v1"}
    assert {alias.choose(f"s{i}") for i in range(500)} == {"v1"}


def test_without_any_serving_target_the_weighted_target_is_named() -> None:
    alias = AliasRoute.build("chat", {"v1": 1}, frozenset())
    assert alias.choose(None) == "v1"  # and the router answers that it has no worker


def test_a_session_sticks_to_one_target() -> None:
    alias = AliasRoute.build("chat", {"v1": 50, "v2": 50}, frozenset({"v1", "v2"}))
    for i in range(200):
        assert len({alias.choose(f"session-{i}") for _ in range(5)}) == 1


def test_raising_the_new_weight_only_moves_sessions_to_it() -> None:
    """Through a rollout's steps, a conversation changes version at most once."""
    keys = [f"user-{i}" for i in range(3000)]
    previous: dict[str, str | None] = {}
    for weight in (5, 25, 50, 75, 100):
        route = AliasRoute.build(
            "chat", {"v1": 100 - weight, "v2": weight}, frozenset({"v1", "v2"})
        )
        now = {key: route.choose(key) for key in keys}
        for key in keys:
            assert not (previous.get(key) == "v2" and now[key] == "v1")
        share = sum(1 for t in now.values() if t == "v2") / len(keys)
        assert abs(share - weight / 100) < 0.04
        previous = dict(now)


def test_request_rewrite_changes_only_the_model_bytes() -> None:
    body = b'{"temperature": 1e-05,  "model" :  "chat", "messages":[{"role":"user","content":"x"}]}'
    out = rewrite_request_model(body, orjson.loads(body), "chat", "llama-3.3-8b")
    assert out == body.replace(b'"chat"', b'"llama-3.3-8b"')


def test_request_rewrite_ignores_the_alias_quoted_inside_text() -> None:
    payload = {"model": "chat", "messages": [{"role": "user", "content": '"model": "chat"'}]}
    body = orjson.dumps(payload)
    out = orjson.loads(rewrite_request_model(body, payload, "chat", "v2"))
    assert out["model"] == "v2"
    assert out["messages"][0]["content"] == '"model": "chat"'


def test_ambiguous_bodies_are_written_out_again_with_the_same_content() -> None:
    body = b'{"model":"chat","metadata":{"model":"chat"},"n":1}'
    out = orjson.loads(rewrite_request_model(body, orjson.loads(body), "chat", "v2"))
    assert out == {"model": "v2", "metadata": {"model": "chat"}, "n": 1}
    escaped = b'{"model":"ch\\u0061t"}'
    assert orjson.loads(rewrite_request_model(escaped, orjson.loads(escaped), "chat", "v2")) == {
        "model": "v2"
    }


STREAM = (
    b"".join(
        b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"llama-3.3-8b",'
        b'"choices":[{"index":0,"delta":{"content":"tok' + str(i).encode() + b'"}}]}\n\n'
        for i in range(3)
    )
    + b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("split", range(0, len(STREAM), 7))
def test_stream_rename_survives_any_chunk_boundary(split: int) -> None:
    rewriter = ModelNameRewriter("llama-3.3-8b", "chat")
    out = rewriter.feed(STREAM[:split]) + rewriter.feed(STREAM[split:]) + rewriter.flush()
    assert out == STREAM.replace(b'"model":"llama-3.3-8b"', b'"model":"chat"')


def test_stream_rename_byte_by_byte_and_with_spaces() -> None:
    text = b'{"model": "v2", "choices": [{"text": "the \\"model\\": \\"v2\\" stays"}]}'
    rewriter = ModelNameRewriter("v2", "public")
    out = b"".join(rewriter.feed(text[i : i + 1]) for i in range(len(text))) + rewriter.flush()
    assert out == b'{"model": "public", "choices": [{"text": "the \\"model\\": \\"v2\\" stays"}]}'


def test_sse_events_are_never_held_back() -> None:
    rewriter = ModelNameRewriter("v2", "public")
    event = b'data: {"model":"v2","choices":[]}\n\n'
    assert rewriter.feed(event) == b'data: {"model":"public","choices":[]}\n\n'


def _worker(wid: int, model: str, max_len: int) -> WorkerView:
    return WorkerView(
        id=wid,
        name=f"w{wid}",
        url=f"http://w{wid}",
        state="active",
        source="operator",
        models=(ModelEntry(model, max_model_len=max_len),),
        queue_length=0,
        last_heartbeat=None,
        routable=True,
    )


def test_models_list_shows_aliases_that_can_serve() -> None:
    snapshot = build_snapshot(
        workers=[_worker(1, "v1", 8192), _worker(2, "v2", 4096)],
        served_models=[],
        generation=1,
        aliases={"chat": {"v1": 90, "v2": 10}, "dead": {"v9": 100}},
    )
    listed = {e["id"]: e for e in orjson.loads(snapshot.models_payload)["data"]}
    assert set(listed) == {"v1", "v2", "chat"}
    assert listed["chat"]["max_model_len"] == 4096
    assert listed["chat"]["owned_by"] == "vllm-control-panel"
    assert set(snapshot.aliases) == {"chat", "dead"}
