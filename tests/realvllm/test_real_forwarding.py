"""Forwarding through the router to real vLLM: what a client gets through the router is what
vLLM answers directly, streamed or not, for the base model and a LoRA adapter; errors come
back unchanged; a client that goes away stops vLLM's work; /metrics is read as vLLM writes it.
Real sockets throughout: uvicorn's router, vLLM's API servers, the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from controlpanel.registry.models import Worker
from tests.realvllm.fleet import PATIENCE_S, register, use_policy, vllm_metric
from tests.realvllm.servers import BLOCK_SIZE, LORA, MAX_MODEL_LEN, MODEL, RealWorker
from tests.support.servers import RouterServer, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
MESSAGES = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


def direct(real: RealWorker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("model", [MODEL, LORA])
def test_routed_answers_equal_direct_ones_streamed_and_not(
    router: RouterServer, client: openai.OpenAI, vllm_pair: list[RealWorker], model: str
) -> None:
    # One worker: the tiny model's random weights leave near ties between its top tokens,
    # which two servers under different batching may break apart even at temperature 0.
    register(router, vllm_pair[:1], events=False)
    ask = {"model": model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    want = direct(vllm_pair[0]).chat.completions.create(**ask)  # type: ignore[call-overload]
    got = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    assert got.model == model
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage is not None and want.usage is not None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    streamed = client.chat.completions.create(**ask, stream=True)  # type: ignore[call-overload]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == want.choices[0].message.content
    completion = {"model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    want_text = direct(vllm_pair[0]).completions.create(**completion).choices[0].text
    assert client.completions.create(**completion).choices[0].text == want_text


def test_an_adapter_answers_otherwise_than_its_base_model(
    router: RouterServer, client: openai.OpenAI, vllm_pair: list[RealWorker]
) -> None:
    # Guards the test above: were the adapter ignored, both would pass and prove nothing.
    register(router, vllm_pair, events=False)
    texts = {
        model: client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=12, temperature=0
        )
        .choices[0]
        .text
        for model in (MODEL, LORA)
    }
    assert texts[MODEL] != texts[LORA]


def test_cached_tokens_come_through_from_vllm(
    router: RouterServer, client: openai.OpenAI, vllm_pair: list[RealWorker]
) -> None:
    register(router, vllm_pair, events=False)
    use_policy(router, "session_affinity")  # both turns on one worker
    long_system = " ".join(f"rule {i} holds." for i in range(60))
    messages = [{"role": "system", "content": long_system}, MESSAGES[1]]
    usages = []
    for _ in range(2):
        answer = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=1,
            user="one-session",  # type: ignore[arg-type]
        )
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        usages.append(
            (answer.usage.prompt_tokens, answer.usage.prompt_tokens_details.cached_tokens)
        )
    (prompt, first), (_, second) = usages
    assert first is not None and second is not None
    assert (
        second == (prompt - 1) // BLOCK_SIZE * BLOCK_SIZE > first
    )  # whole blocks, bar the last token


def vllm_error(real: RealWorker, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{real.url}/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 10)}]},
        {"messages": MESSAGES, "max_tokens": MAX_MODEL_LEN * 4},
        {"messages": MESSAGES, "stream_options": {"include_usage": True}},
        {"messages": MESSAGES, "stream": True, "max_tokens": MAX_MODEL_LEN * 4},
    ],
    ids=["prompt-too-long", "max-tokens-over", "stream-options-alone", "streamed-over"],
)
def test_vllms_errors_are_relayed_unchanged(
    router: RouterServer, vllm_pair: list[RealWorker], body: dict[str, object]
) -> None:
    register(router, vllm_pair, events=False)
    body = {"model": MODEL, **body}
    want = vllm_error(vllm_pair[0], body)
    got = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert want.status_code == 400
    assert got.status_code == want.status_code
    assert orjson.loads(got.content) == orjson.loads(want.content)  # type, param, message


def test_an_unknown_model_gets_an_openai_error_from_the_router(
    router: RouterServer, client: openai.OpenAI, vllm_pair: list[RealWorker]
) -> None:
    register(router, vllm_pair, events=False)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=MESSAGES)  # type: ignore[arg-type]
    assert "nope" in str(caught.value)


def test_a_client_that_goes_away_stops_vllms_work(
    router: RouterServer, client: openai.OpenAI, vllm_pair: list[RealWorker]
) -> None:
    workers = register(router, vllm_pair, events=False)
    before = [vllm_metric(real, "vllm:generation_tokens_total") for real in vllm_pair]
    budget = MAX_MODEL_LEN - 64
    stream = client.completions.create(
        model=MODEL, prompt="Count with me:", max_tokens=budget, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client hangs up
    running = "vllm:num_requests_running"
    wait_until(lambda: all(vllm_metric(r, running) == 0 for r in vllm_pair), timeout=PATIENCE_S)
    made = sum(vllm_metric(r, "vllm:generation_tokens_total") for r in vllm_pair) - sum(before)
    assert 3 <= made < budget  # stopped, not generated to the end
    assert all(isinstance(w, Worker) for w in workers)


def test_metrics_are_read_as_vllm_writes_them(
    router: RouterServer, client: openai.OpenAI, vllm_pair: list[RealWorker]
) -> None:
    workers = register(router, vllm_pair, events=False)
    for worker in workers:
        worker.refresh_from_db()
        metrics = worker.metrics or {}
        # Known values (zeros at rest), never "unknown": vLLM exports every one of them.
        assert metrics.get("running") == 0 and metrics.get("waiting") == 0
        assert metrics.get("kv_cache_usage") is not None
    # vllm:cache_config_info's block size, in the router's snapshot once it is refreshed.
    wait_until(
        lambda: all(router.workers()[w.pk]["kv_block_size"] == BLOCK_SIZE for w in workers),
        timeout=PATIENCE_S,
    )
