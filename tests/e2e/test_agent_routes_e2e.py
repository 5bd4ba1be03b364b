"""Coding agents' routes through the real router to simulated vLLM workers: Anthropic's
/v1/messages (whole and streamed, a tool-use history as Claude Code sends it) and count_tokens
with the official `anthropic` client, the render, batch and token-in generate routes with the
`openai` client; each answer byte for byte what the worker sent, the router's own refusals on
Anthropic's routes in Anthropic's shape, usage counted for streamed messages, the access log
and /metrics seeing every route, and the routes a router must never forward shielded."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlpanel.registry.models import KeyUsage, RoutingGeneration, Worker
from simulator.server import RunningSimulator
from tests.support.keyed import add_keyed_worker, issue
from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

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
# Claude Code's shape: a system prompt, tools, and a turn history with a tool call and its result.
TOOL_USE = {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "R"}}
TOOL_RESULT = {"type": "tool_result", "tool_use_id": "toolu_01", "content": "# Hi"}
AGENT_TURN: dict[str, Any] = {
    "model": "m",
    "max_tokens": 6,
    "system": "You are a coding agent. Use the tools.",
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "What does the file R say?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Reading it."}, TOOL_USE]},
        {"role": "user", "content": [TOOL_RESULT]},
    ],
}


def claude(router: RouterServer, key: str = "unused") -> anthropic.Anthropic:
    # auth_token: `Authorization: Bearer`, as Claude Code sends ANTHROPIC_AUTH_TOKEN.
    return anthropic.Anthropic(base_url=router.url, auth_token=key, max_retries=0)


def both(router: RouterServer, sim: RunningSimulator, path: str, body: Any) -> list[bytes]:
    """The same request (the same X-Request-ID, so the same ids) routed and sent directly."""
    headers = {"X-Request-ID": "agent-1"}
    return [
        httpx.post(base + path, json=body, headers=headers, timeout=30).content
        for base in (router.url, sim.url)
    ]


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind
    message: str = body["error"]["message"]
    return message


def test_messages_whole_and_streamed_with_the_anthropic_client(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m")
    add_worker(sim)
    client = claude(router)
    message = client.messages.create(**AGENT_TURN)
    assert message.type == "message" and message.role == "assistant" and message.model == "m"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    assert message.content[0].type == "text" and len(message.content[0].text.split()) == 6
    with client.messages.stream(**AGENT_TURN) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].type == "text" and final.content[0].text == message.content[0].text
    assert final.usage.output_tokens == 6
    # What vLLM would have rendered: the tool call and its result are in the prompt.
    sent = [r for r in sim.state.requests if r["path"] == "/v1/messages"]
    assert len(sent) == 2 and orjson.loads(sent[1]["body"])["messages"][1]["content"][1]["id"]


def test_streamed_messages_are_relayed_unchanged(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m")
    add_worker(sim)
    routed, direct = both(router, sim, "/v1/messages", {**AGENT_TURN, "stream": True})
    assert routed == direct
    events = [block.split(b"\n")[0] for block in routed.split(b"\n\n") if block]
    assert events == [
        b"event: message_start", b"event: content_block_start",
        *[b"event: content_block_delta"] * 6,
        b"event: content_block_stop", b"event: message_delta", b"event: message_stop",
    ]  # fmt: skip
    whole, whole_direct = both(router, sim, "/v1/messages", AGENT_TURN)
    assert whole == whole_direct and json.loads(whole)["id"] == "chatcmpl-agent-1"


def test_count_tokens(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m")
    add_worker(sim)
    ask = {k: AGENT_TURN[k] for k in ("model", "system", "tools", "messages")}
    counted = claude(router).messages.count_tokens(**ask)
    routed, direct = both(router, sim, "/v1/messages/count_tokens", ask)
    assert routed == direct
    assert counted.input_tokens == json.loads(direct)["input_tokens"] > 0


def test_the_routers_own_refusals_on_anthropic_routes_are_anthropic_errors(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude(router).messages.create(**{**AGENT_TURN, "model": "absent"})
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `absent` does not exist."},
    }
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        anthropic_error(router.post(path, content=b'{"model": '), 400, "invalid_request_error")
        anthropic_error(router.post(path, json={"messages": []}), 400, "invalid_request_error")
        anthropic_error(router.get(path), 405, "invalid_request_error")
    anthropic_error(router.post("/v1/messages/batches", json={}), 404, "not_found_error")
    # vLLM's render route answers in its OpenAI shape, and so does the router there.
    assert "error" in router.post("/v1/messages/render", json={"model": "absent"}).json()
    worker = add_worker(simulator("m"))
    Worker.objects.filter(pk=worker.pk).update(state="drained")
    RoutingGeneration.bump()
    router.wait_for(lambda seen: seen[worker.pk]["routable"] is False)
    with pytest.raises(anthropic.APIStatusError) as unavailable:
        claude(router).messages.create(**AGENT_TURN)
    assert unavailable.value.status_code == 503
    assert unavailable.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


def test_keyed_refusals_are_anthropic_errors_and_streamed_messages_are_counted(
    keyed_router: RouterServer,
    simulator: StartSimulator,
) -> None:
    everything = issue(keyed_router, "ops")
    sim = simulator("m")
    add_keyed_worker(keyed_router, sim, everything)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        claude(keyed_router, "sk-wrong-key-0000000000").messages.create(**AGENT_TURN)
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    team = issue(keyed_router, "team", rpm=2)
    client = claude(keyed_router, team)
    with client.messages.stream(**AGENT_TURN) as stream:
        usage = stream.get_final_message().usage
    # The SDK's api_key (Claude Code's ANTHROPIC_API_KEY) comes as x-api-key, never forwarded.
    x_api_key = anthropic.Anthropic(base_url=keyed_router.url, api_key=team, max_retries=0)
    whole = x_api_key.messages.create(**AGENT_TURN)
    sent = [r["headers"] for r in sim.state.requests if r["path"] == "/v1/messages"]
    assert len(sent) == 2 and not any(
        name.lower() in ("authorization", "x-api-key") for headers in sent for name in headers
    )
    with pytest.raises(anthropic.RateLimitError) as limited:
        client.messages.create(**AGENT_TURN)
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]

    def recorded() -> tuple[int, int, int] | None:
        row = KeyUsage.objects.filter(api_key__name="team", model="m").first()
        return None if row is None else (row.requests, row.prompt_tokens, row.completion_tokens)

    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) == prompt
    wait_until(lambda: recorded() == (2, 2 * prompt, 12))


def test_render_batch_and_generate_with_the_openai_client(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m")
    add_worker(sim)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    rendered: Any = client.post("/chat/completions/render", body=chat, cast_to=object)
    assert rendered["model"] == "m" and rendered["token_ids"]
    prompts: Any = client.post(
        "/completions/render", body={"model": "m", "prompt": ["a b", "c"]}, cast_to=object
    )
    assert [len(p["token_ids"]) for p in prompts] == [2, 1]
    conversations = {**chat, "messages": [chat["messages"], chat["messages"]], "max_tokens": 3}
    batch: Any = client.post("/chat/completions/batch", body=conversations, cast_to=object)
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["usage"]["completion_tokens"] == 6
    generate = {
        "model": "m",
        "token_ids": rendered["token_ids"],
        "sampling_params": {"max_tokens": 3},
    }
    generated: Any = client.post(
        f"{router.url}/inference/v1/generate", body=generate, cast_to=object
    )
    assert len(generated["choices"][0]["token_ids"]) == 3
    for path, body in [
        ("/v1/chat/completions/render", chat),
        ("/v1/completions/render", {"model": "m", "prompt": "a b"}),
        ("/v1/messages/render", {**AGENT_TURN}),
        ("/inference/v1/generate", {**generate, "stream": True}),
    ]:
        routed, direct = both(router, sim, path, body)
        assert routed == direct, path
    streamed = both(router, sim, "/inference/v1/generate", {**generate, "stream": True})[0]
    assert streamed.endswith(b"data: [DONE]\n\n") and streamed.count(b'"token_ids"') == 3
    unknown = router.post("/inference/v1/generate", json={**generate, "model": "absent"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"


def test_every_route_is_in_the_access_log_and_metrics(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m")
    add_worker(sim, name="agent-w")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    bodies = {
        "/v1/messages": AGENT_TURN,
        "/v1/messages/count_tokens": {"model": "m", "messages": AGENT_TURN["messages"]},
        "/v1/chat/completions/render": chat,
        "/v1/completions/render": {"model": "m", "prompt": "a"},
        "/v1/chat/completions/batch": {**chat, "messages": [chat["messages"]]},
        "/inference/v1/generate": {
            "model": "m",
            "token_ids": [1],
            "sampling_params": {"max_tokens": 2},
        },
    }
    before = served(router, "agent-w")
    for i, (path, body) in enumerate(bodies.items()):
        rid = f"agent-route-{i}"
        response = router.post(path, json=body, headers={"X-Request-ID": rid})
        assert response.status_code == 200, (path, response.text)
        wait_until(lambda rid=rid: bool(access_lines(router, rid)))  # type: ignore[misc]
        line = access_lines(router, rid)[0]
        assert (line["path"], line["model"], line["worker"], line["status"]) == (
            path, "m", "agent-w", 200,
        )  # fmt: skip
    assert sim.state.by_path.keys() >= bodies.keys()
    assert served(router, "agent-w") - before == len(bodies)


def served(router: RouterServer, worker: str) -> float:
    """The router's count of the requests it sent to `worker`."""
    total = 0.0
    for family in text_string_to_metric_families(router.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "controlpanel_router_requests_total":
                total += sample.value if sample.labels.get("worker") == worker else 0.0
    return total


def access_lines(router: RouterServer, request_id: str) -> list[dict[str, Any]]:
    found = []
    for line in router.log().splitlines():
        if line.startswith("{") and request_id in line:
            entry = json.loads(line)
            if entry.get("request_id") == request_id:
                found.append(entry)
    return found


@pytest.mark.parametrize(
    "path",
    [
        "/inference/v1/abort_requests",
        "/abort_requests",
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        "/adapters",
        "/adapters/some-lora",
        "/invocations",
        "/reset_prefix_cache",
    ],
)
def test_routes_a_router_must_never_forward_are_shielded(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker, path: str
) -> None:
    sim = simulator("m")
    add_worker(sim)
    for method in ("POST", "DELETE", "GET"):
        response = httpx.request(method, router.url + path, json={"model": "m"}, timeout=10)
        assert response.status_code == 404, (method, path)
        assert response.json()["error"]["code"] == 404
    assert path not in sim.state.by_path
