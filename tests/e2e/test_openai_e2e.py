"""The official OpenAI client, through the real router, to simulated vLLM workers."""

from __future__ import annotations

import openai
import pytest

from controlpanel.registry.models import Worker
from simulator.server import RunningSimulator
from tests.support.servers import AddWorker, RouterServer, StartSimulator

pytestmark = pytest.mark.django_db(transaction=True)


Fleet = tuple[list[RunningSimulator], list[Worker]]


@pytest.fixture
def fleet(simulator: StartSimulator, add_worker: AddWorker) -> Fleet:
    sims = [simulator("llama", loras=("sql-lora",)), simulator("llama"), simulator("embedder")]
    workers = [add_worker(sim) for sim in sims]
    return sims, workers


def test_chat_completion(client: openai.OpenAI, fleet: Fleet) -> None:
    reply = client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hello there"}], max_tokens=5
    )
    assert reply.model == "llama"
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 5


def test_chat_completion_stream_with_usage(client: openai.OpenAI, fleet: Fleet) -> None:
    stream = client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 8
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_completion_plain_and_streamed(client: openai.OpenAI, fleet: Fleet) -> None:
    plain = client.completions.create(model="llama", prompt="once upon a time", max_tokens=4)
    assert len(plain.choices[0].text.split()) == 4
    streamed = list(
        client.completions.create(model="llama", prompt="once upon", max_tokens=6, stream=True)
    )
    words = "".join(c.choices[0].text for c in streamed).split()
    assert len(words) == 6
    assert words[:4] == plain.choices[0].text.split()  # the simulator's deterministic output
    assert streamed[-1].choices[0].finish_reason == "length"


def test_lora_adapter_is_routed_to_its_worker(client: openai.OpenAI, fleet: Fleet) -> None:
    sims, _ = fleet
    for _ in range(5):
        reply = client.chat.completions.create(
            model="sql-lora", messages=[{"role": "user", "content": "select"}], max_tokens=2
        )
        assert reply.model == "sql-lora"
    assert sims[0].state.completed == 5
    assert sims[1].state.completed == 0


def test_embeddings(client: openai.OpenAI, fleet: Fleet) -> None:
    result = client.embeddings.create(model="embedder", input=["a", "b c"])
    assert [d.index for d in result.data] == [0, 1]
    assert len(result.data[0].embedding) > 0
    assert fleet[0][2].state.completed == 1


def test_models_list_merges_workers_with_lora_parent(
    client: openai.OpenAI, router: RouterServer, fleet: Fleet
) -> None:
    ids = [m.id for m in client.models.list()]
    assert sorted(ids) == ["embedder", "llama", "sql-lora"]  # each id once
    raw = {m["id"]: m for m in router.get("/v1/models").json()["data"]}
    assert raw["sql-lora"]["parent"] == "llama"
    assert raw["llama"]["parent"] is None
    assert raw["llama"]["owned_by"] == "vllm"
    assert router.get("/list_models").json() == {"models": ["embedder", "llama", "sql-lora"]}


def test_models_retrieve(client: openai.OpenAI, fleet: Fleet) -> None:
    model = client.models.retrieve("sql-lora")
    assert model.id == "sql-lora"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("absent")


def test_model_ids_with_a_slash(
    client: openai.OpenAI, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    add_worker(simulator("meta-llama/Llama-3.1-8B-Instruct"))
    assert client.models.retrieve("meta-llama/Llama-3.1-8B-Instruct").id.endswith("Instruct")
    reply = client.completions.create(
        model="meta-llama/Llama-3.1-8B-Instruct", prompt="x", max_tokens=1
    )
    assert reply.model == "meta-llama/Llama-3.1-8B-Instruct"
