"""Coding agents' routes through the router to real vLLM 0.32: Claude Code's request shape (the
`anthropic` client, tools, a tool-use turn history, streamed, temperature 0) relayed byte for
byte as vLLM answers it directly; count_tokens, the render routes, batch and the token-in
generate the same; the router's own refusals on Anthropic's routes in Anthropic's shape and
vLLM's own errors relayed unchanged; the routes a router never forwards shielded though vLLM
serves them; and the simulator checked against the real server, route by route, shape by shape.

Each pair of requests compared carries the same X-Request-ID (vLLM builds its ids from it) and
its own `cache_salt`, so neither finds the other's blocks in the prefix cache and both report
the same usage. Where the model generates, the router has one of the two servers only and the
direct request goes to that one: the tiny model's random weights leave near ties between its
top tokens, which the two servers were seen to break apart at temperature 0."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from controlpanel.fleet import health, services
from tests.realvllm.fleet import register
from tests.realvllm.servers import MAX_MODEL_LEN, MODEL, RealWorker
from tests.support.servers import RouterServer, StartSimulator
from tests.support.tap import tap

pytestmark = pytest.mark.django_db(transaction=True)
_salts = itertools.count()

TOOLS: list[Any] = [
    {
        "name": "read_file",
        "description": "Read a file of the repository",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    }
]
TOOL_USE = {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "R.md"}}
TOOL_RESULT = {"type": "tool_result", "tool_use_id": "toolu_01", "content": "# Hello"}
# Claude Code's shape: a system prompt, tools, and a history with a tool call and its result.
AGENT_TURN: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 8,
    "system": "You are a coding agent. Use the tools.",
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "What does R.md say?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Reading it."}, TOOL_USE]},
        {"role": "user", "content": [TOOL_RESULT]},
    ],
}
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}]}


def salted(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "cache_salt": f"salt-{next(_salts)}"}


def routed_and_direct(
    router: RouterServer, real: RealWorker, path: str, body: dict[str, Any], *, salt: bool = True
) -> list[httpx.Response]:
    """The same request through the router and straight to `real`, each with its own salt."""
    headers = {"X-Request-ID": f"agent-{next(_salts)}"}
    return [
        httpx.post(base + path, json=salted(body) if salt else body, headers=headers, timeout=120)
        for base in (router.url, real.url)
    ]


def claude(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, auth_token="unused", max_retries=0, timeout=120)


def without(answer: httpx.Response, *fields: str) -> Any:
    value = answer.json()
    return {k: v for k, v in value.items() if k not in fields}


def test_claude_codes_streamed_tool_turn_is_relayed_as_vllm_sends_it(
    router: RouterServer, vllm_pair: list[RealWorker]
) -> None:
    real = vllm_pair[0]
    body = {**AGENT_TURN, "stream": True, "temperature": 0}
    with tap("127.0.0.1", real.server.port) as recorded:
        # The router reaches the server through the tap: what the client gets is compared with
        # the answer vLLM gave to that very request (two generations may break a near tie
        # apart), and the direct request only with its shape.
        worker = services.worker_add(url=recorded.url, name="real-tapped", actor="test")
        health.workers_probe()
        router.wait_routable(worker)
        routed, direct = routed_and_direct(router, real, "/v1/messages", body)
        # The official client, as Claude Code drives it, through the router.
        greedy = {"extra_body": {"temperature": 0}}
        stream = claude(router.url).messages.create(**AGENT_TURN, stream=True, **greedy)  # type: ignore[call-overload]
        events = list(stream)
        answers = recorded.answers_to(b"POST /v1/messages")
    assert answers[0] == (200, routed.content)
    assert routed.headers["content-type"].startswith("text/event-stream")
    for answer in (routed, direct):
        assert answer.status_code == 200
        names = [block.split(b"\n")[0] for block in answer.content.split(b"\n\n") if block]
        assert names[:2] == [b"event: message_start", b"event: content_block_start"]
        assert names[-1] == b"event: message_stop" and b"event: message_delta" in names
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    text = "".join(d.text for d in deltas if d.type == "text_delta")
    assert len(answers) == 2 and answers[1][0] == 200
    assert text and text == sse_text(answers[1][1])


def sse_text(stream: bytes) -> str:
    """The text deltas of an Anthropic event stream, as vLLM sent them."""
    text = []
    for block in stream.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                event = orjson.loads(line[6:])
                delta = event.get("delta", {}) if event.get("type") == "content_block_delta" else {}
                text.append(delta.get("text", "") if delta.get("type") == "text_delta" else "")
    return "".join(text)


def test_messages_and_count_tokens_routed_equal_direct(
    router: RouterServer, vllm_pair: list[RealWorker]
) -> None:
    register(router, vllm_pair[:1], events=False)  # see the module's docstring
    routed, direct = routed_and_direct(
        router, vllm_pair[0], "/v1/messages", {**AGENT_TURN, "temperature": 0}
    )
    assert direct.status_code == 200 and routed.content == direct.content
    assert direct.json()["type"] == "message"
    ask = {k: AGENT_TURN[k] for k in ("model", "system", "tools", "messages")}
    routed, direct = routed_and_direct(
        router, vllm_pair[0], "/v1/messages/count_tokens", ask, salt=False
    )
    assert direct.status_code == 200 and routed.content == direct.content
    counted = claude(router.url).messages.count_tokens(**ask)
    assert counted.input_tokens == direct.json()["input_tokens"] > 0


def test_render_batch_and_generate_routed_equal_direct(
    router: RouterServer, vllm_pair: list[RealWorker]
) -> None:
    register(router, vllm_pair[:1], events=False)  # see the module's docstring
    for path, body in [
        ("/v1/chat/completions/render", {**CHAT, "max_tokens": 4}),
        ("/v1/completions/render", {"model": MODEL, "prompt": ["Hello there", "Bye"]}),
        ("/v1/messages/render", AGENT_TURN),
    ]:
        routed, direct = routed_and_direct(router, vllm_pair[0], path, body, salt=False)
        assert direct.status_code == 200, (path, direct.text)
        assert routed.content == direct.content, path
    rendered = direct.json()
    conversations = {
        "model": MODEL, "max_tokens": 4, "temperature": 0,
        "messages": [CHAT["messages"], [{"role": "user", "content": "Bye now"}]],
    }  # fmt: skip
    routed, direct = routed_and_direct(
        router, vllm_pair[0], "/v1/chat/completions/batch", conversations
    )
    assert direct.status_code == 200 and len(direct.json()["choices"]) == 2
    assert without(routed, "created") == without(direct, "created")
    generate = {
        "model": MODEL,
        "token_ids": rendered["token_ids"],
        "sampling_params": {"max_tokens": 4, "temperature": 0},
    }
    routed, direct = routed_and_direct(router, vllm_pair[0], "/inference/v1/generate", generate)
    assert direct.status_code == 200 and len(direct.json()["choices"][0]["token_ids"]) == 4
    assert without(routed, "created") == without(direct, "created")
    streamed = {**generate, "stream": True, "stream_options": {"include_usage": True}}
    routed, direct = routed_and_direct(router, vllm_pair[0], "/inference/v1/generate", streamed)
    assert direct.status_code == 200 and direct.content.endswith(b"data: [DONE]\n\n")
    assert routed.content == direct.content


def test_refusals_on_anthropic_routes_and_vllms_own_errors(
    router: RouterServer, vllm_pair: list[RealWorker]
) -> None:
    register(router, vllm_pair, events=False)
    with pytest.raises(anthropic.NotFoundError) as caught:  # the router's own: no such model
        claude(router.url).messages.create(**{**AGENT_TURN, "model": "absent"})
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `absent` does not exist."},
    }
    bad_json = httpx.post(f"{router.url}/v1/messages", content=b'{"model": ', timeout=30)
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["type"] == "invalid_request_error"
    # vLLM's own errors come back as vLLM sent them: a missing field (FastAPI's OpenAI
    # shape), a prompt too long (the Anthropic shape with vLLM's type name).
    too_long = [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 10)}]
    for body in (
        {k: v for k, v in AGENT_TURN.items() if k != "max_tokens"},
        {**AGENT_TURN, "messages": too_long},
    ):
        routed, direct = routed_and_direct(router, vllm_pair[0], "/v1/messages", body)
        assert direct.status_code == 400
        assert (routed.status_code, routed.content) == (400, direct.content)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions/derender",
        "/v1/completions/derender",
        "/v1/responses/render",
        "/generative_scoring",
        "/v1/systemone",
    ],
)
def test_vllms_other_inference_routes_are_forwarded_by_model(
    router: RouterServer, vllm_pair: list[RealWorker], path: str
) -> None:
    # vLLM's answer to a body its route refuses, through the router as sent directly: the
    # route is forwarded (the simulator does not serve these).
    register(router, vllm_pair, events=False)
    routed, direct = routed_and_direct(router, vllm_pair[0], path, {"model": MODEL}, salt=False)
    assert direct.status_code == 400 and "validation error" in direct.json()["error"]["message"]
    assert (routed.status_code, routed.content) == (400, direct.content)
    unknown = httpx.post(router.url + path, json={"model": "absent"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/inference/v1/abort_requests", {"request_ids": ["x"]}),
        ("/is_scaling_elastic_ep", {}),
        ("/invocations", {"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
    ],
)
def test_routes_vllm_serves_but_a_router_never_forwards(
    router: RouterServer, vllm_pair: list[RealWorker], path: str, body: dict[str, Any]
) -> None:
    register(router, vllm_pair, events=False)
    assert httpx.post(vllm_pair[0].url + path, json=body, timeout=60).status_code == 200
    shielded = httpx.post(router.url + path, json=body, timeout=30)
    assert shielded.status_code == 404 and shielded.json()["error"]["code"] == 404


def shape(value: Any) -> Any:
    """A JSON value with its leaves replaced by their kinds, keys kept in order."""
    if isinstance(value, dict):
        return [(key, shape(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return value if value is None else "bool"
    return "number" if isinstance(value, int | float) else type(value).__name__


def stream_shape(content: bytes) -> list[Any]:
    """An SSE stream's events as (event name, shape of its data), repeats merged."""
    events: list[Any] = []
    for block in content.split(b"\n\n"):
        lines = dict(line.split(b": ", 1) for line in block.split(b"\n") if b": " in line)
        if b"data" in lines and lines[b"data"] != b"[DONE]":
            event = (lines.get(b"event"), shape(orjson.loads(lines[b"data"])))
            if not events or events[-1] != event:
                events.append(event)
    return events


def test_the_simulator_answers_in_real_vllms_shapes(
    router: RouterServer,
    vllm_pair: list[RealWorker],
    simulator: StartSimulator,
    tiny_folder: Path,
) -> None:
    sim = simulator(
        MODEL, tokenizer=str(tiny_folder), enable_prompt_tokens_details=True, block_size=32,
        max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip
    generate = {"model": MODEL, "token_ids": [19556, 905], "sampling_params": {"max_tokens": 3}}
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/messages", {**AGENT_TURN, "max_tokens": 3}),
        ("/v1/messages", {**AGENT_TURN, "max_tokens": 3, "stream": True}),
        ("/v1/messages/count_tokens", {k: v for k, v in AGENT_TURN.items() if k != "max_tokens"}),
        ("/v1/chat/completions/render", {**CHAT, "max_tokens": 4}),
        ("/v1/completions/render", {"model": MODEL, "prompt": ["Hello there", "Bye"]}),
        ("/v1/messages/render", AGENT_TURN),
        ("/v1/chat/completions/batch", {**CHAT, "messages": [CHAT["messages"]] * 2}),
        ("/inference/v1/generate", generate),
        ("/inference/v1/generate", {**generate, "stream": True,
                                    "stream_options": {"include_usage": True}}),
        ("/v1/messages", {**AGENT_TURN, "model": "absent"}),
        ("/v1/messages", {k: v for k, v in AGENT_TURN.items() if k != "max_tokens"}),
        ("/inference/v1/generate", {**generate, "model": "absent"}),
    ]  # fmt: skip
    differences = []  # every case's, so one run shows them all
    for path, body in cases:
        real, simulated = (
            httpx.post(base + path, json=body, timeout=120) for base in (vllm_pair[0].url, sim.url)
        )
        what = f"{path} {json.dumps(body)[:60]}"
        if (real.status_code, real.headers["content-type"]) != (
            simulated.status_code,
            simulated.headers["content-type"],
        ):
            differences.append((what, real.status_code, simulated.status_code, real.text))
        elif real.headers["content-type"].startswith("text/event-stream"):
            if stream_shape(simulated.content) != stream_shape(real.content):
                differences.append((what, real.text, simulated.text))
        elif shape(simulated.json()) != shape(real.json()):
            differences.append((what, real.text, simulated.text))
        elif path in ("/v1/messages/count_tokens", "/v1/chat/completions/render"):
            for field in ("token_ids", "input_tokens"):
                if simulated.json().get(field) != real.json().get(field):
                    differences.append((what, real.text, simulated.text))
    assert not differences, "\n\n".join(map(str, differences))
