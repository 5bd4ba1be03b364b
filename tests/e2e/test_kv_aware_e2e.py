"""kv_aware end to end: the real router (uvicorn, the session's), simulated vLLM workers that
publish KV cache events over ZeroMQ and report cached tokens, the official `openai` client.

What each test proves is in its name; the numbers come from the router's own /metrics and
from the simulators' request counts, never from the code under test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlpanel.fleet import health, served_models, services
from controlpanel.registry.models import Worker
from harness.tokenizer_folder import make_tokenizer_folder
from simulator.server import RunningSimulator
from tests.support.common import ADMIN_HEADERS
from tests.support.servers import RouterServer, StartSimulator, free_ports, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
SYSTEM = " ".join(f"rule{i} applies" for i in range(120))  # 240 words: 15 blocks of 16


def metric(router: RouterServer, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when none)."""
    total = 0.0
    for family in text_string_to_metric_families(router.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def kv_fleet(
    router: RouterServer,
    simulator: StartSimulator,
    model: str,
    n: int,
    *,
    events: bool = True,
    tokenizer: str = "",
) -> tuple[list[RunningSimulator], list[Worker]]:
    """n simulators of `model` reporting cached tokens; with `events`, each publishes its KV
    events (and a replay socket) and is registered with them, and the router's index of
    each is trusted before this returns."""
    sims, workers = [], []
    for i in range(n):
        ports = free_ports(2) if events else [0, 0]
        sim = simulator(model, enable_prompt_tokens_details=True, kv_events_port=ports[0],
                        kv_events_replay_port=ports[1], tokenizer=tokenizer)  # fmt: skip
        endpoints = [f"tcp://127.0.0.1:{port}" if port else "" for port in ports]
        worker = services.worker_add(
            url=sim.url, name=f"{model}-{i}", actor="test",
            kv_events=endpoints[0], kv_events_replay=endpoints[1],
        )  # fmt: skip
        sims.append(sim)
        workers.append(worker)
    health.workers_probe()  # as Celery would: vllm:cache_config_info states the block size
    router.wait_routable(*workers)
    for worker in workers if events else ():
        wait_until(
            lambda w=worker: metric(router, "controlpanel_router_kv_index_trusted", worker=w.name),
        )
    return sims, workers


def use_kv_aware(router: RouterServer, model: str, **config: Any) -> None:
    served_models.served_model_set_policy(
        name=model, policy="kv_aware", policy_config=config, actor="test"
    )
    applied = f'controlpanel_router_model_policy{{model="{model}",policy="kv_aware"}}'
    wait_until(lambda: applied in router.get("/metrics").text)


def conversation(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question number {i} about the rules"})
        messages.append({"role": "assistant", "content": f"answer number {i}"})
    return messages


def ask(client: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> int:
    """Send one chat request; returns the cached tokens the worker reported."""
    return usage(client, model, messages)[0]


def usage(client: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> tuple[int, int]:
    """Send one chat request; returns (cached tokens, prompt tokens) as the worker said."""
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached, answer.usage.prompt_tokens


def indexed_blocks(router: RouterServer, worker: Worker) -> float:
    return metric(router, "controlpanel_router_kv_index_blocks", worker=worker.name)


def served(sims: list[RunningSimulator]) -> list[int]:
    return [sim.state.completed for sim in sims]


def decisions(router: RouterServer, model: str, decision: str) -> float:
    return metric(
        router, "controlpanel_router_policy_decisions_total", model=model, decision=decision
    )


def checked(router: RouterServer, model: str, policy: str) -> tuple[float, float]:
    """(requests checked, within one block) for the model and policy."""
    labels = {"model": model, "policy": policy}
    count = metric(router, "controlpanel_router_cache_prediction_error_tokens_count", **labels)
    within = metric(router, "controlpanel_router_cache_predictions_within_block_total", **labels)
    return count, within


# -- the exact path: the worker's /tokenize, the index from its events ---------------------


def test_a_conversation_follows_the_worker_holding_its_blocks_and_predictions_hold(
    router: RouterServer, simulator: StartSimulator, client: openai.OpenAI
) -> None:
    model = "kv-exact"
    sims, workers = kv_fleet(router, simulator, model, 3)
    use_kv_aware(router, model)
    cached = []
    holder: Worker | None = None
    for turn in range(7):
        reported, prompt = usage(client, model, conversation(turn))
        cached.append(reported)
        holder = holder or workers[served(sims).index(1)]
        # each turn's blocks in the index before the next turn (events arrive on their own)
        wait_until(lambda h=holder, p=prompt: indexed_blocks(router, h) >= p // 16)
    assert holder is not None and served(sims)[workers.index(holder)] == 7
    assert sum(served(sims)) == 7
    assert all(c >= 15 * 16 for c in cached[1:])  # the system prompt at least, every time
    assert decisions(router, model, "kv") >= 6
    # every answer checked, every prediction within a block of what the worker reported
    wait_until(lambda: checked(router, model, "kv_aware") == (7.0, 7.0))
    labels = {"model": model, "policy": "kv_aware"}
    predicted = metric(router, "controlpanel_router_cache_predicted_tokens_total", **labels)
    reported = metric(router, "controlpanel_router_cache_reported_tokens_total", **labels)
    assert predicted == reported == sum(cached)
    # tokens came from the workers' /tokenize: one hop per request, timed
    assert metric(router, "controlpanel_router_tokenize_requests_total", model=model,
                  outcome="worker") == 7  # fmt: skip
    assert metric(router, "controlpanel_router_tokenize_seconds_count", model=model,
                  source="worker") == 7  # fmt: skip
    assert metric(router, "controlpanel_router_kv_aware_fallbacks_total", model=model) == 0


def test_a_streamed_answer_is_checked_from_its_usage_event(
    router: RouterServer, simulator: StartSimulator, client: openai.OpenAI
) -> None:
    model = "kv-stream"
    kv_fleet(router, simulator, model, 2)
    use_kv_aware(router, model)
    for turn in range(3):
        stream = client.chat.completions.create(
            model=model, messages=conversation(turn), max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        assert chunks[-1].usage is not None
        wait_until(lambda t=turn: checked(router, model, "kv_aware")[0] == t + 1)
    assert checked(router, model, "kv_aware") == (3.0, 3.0)
    without_usage = client.chat.completions.create(
        model=model,
        messages=conversation(3),
        max_tokens=2,
        stream=True,
    )
    assert len(list(without_usage)) >= 2
    unchecked = "controlpanel_router_cache_predictions_unchecked_total"
    wait_until(lambda: metric(router, unchecked, model=model, policy="kv_aware") == 1)


def test_a_cleared_cache_is_seen_at_once_never_trusted_stale(
    router: RouterServer, simulator: StartSimulator, client: openai.OpenAI
) -> None:
    model = "kv-clear"
    sims, workers = kv_fleet(router, simulator, model, 2)
    use_kv_aware(router, model)
    ask(client, model, conversation(0))
    holder = served(sims).index(1)
    wait_until(lambda: indexed_blocks(router, workers[holder]) >= 15)
    httpx.post(sims[holder].url + "/reset_prefix_cache", timeout=10).raise_for_status()
    wait_until(lambda: indexed_blocks(router, workers[holder]) == 0)
    assert ask(client, model, conversation(1)) == 0  # nobody holds it now: a miss...
    assert decisions(router, model, "miss") == 2
    wait_until(lambda: checked(router, model, "kv_aware") == (2.0, 2.0))  # ...and predicted so


def test_route_explain_shows_each_workers_cached_tokens_from_events(
    router: RouterServer, simulator: StartSimulator, client: openai.OpenAI
) -> None:
    model = "kv-explain"
    sims, workers = kv_fleet(router, simulator, model, 2)
    use_kv_aware(router, model)
    ask(client, model, conversation(0))
    holder = workers[served(sims).index(1)]
    wait_until(lambda: indexed_blocks(router, holder) >= 15)
    body = {"model": model, "messages": conversation(1), "max_tokens": 1}
    answer = router.post("/v1/chat/completions", json=body, headers={"X-Route-Explain": "1"})
    assert answer.status_code == 200, answer.text
    told = orjson.loads(answer.headers["x-route-explain"])
    assert (told["policy"], told["decision"], told["worker"]) == ("kv_aware", "kv", holder.name)
    best, other = told["candidates"]
    assert best["worker"] == holder.name and best["source"] == other["source"] == "events"
    assert best["cached_tokens"] >= 15 * 16 > other["cached_tokens"] == 0
    assert best["cost"] < other["cost"]


# -- the fallback: workers without events, counted -------------------------------------------


def test_workers_without_events_fall_back_to_the_approximate_index_counted(
    router: RouterServer, simulator: StartSimulator, client: openai.OpenAI
) -> None:
    model = "kv-fallback"
    sims, _ = kv_fleet(router, simulator, model, 3, events=False)
    use_kv_aware(router, model)
    for turn in range(5):
        ask(client, model, conversation(turn))
    assert sorted(served(sims)) == [0, 0, 5]  # the approximate index kept the conversation
    assert metric(router, "controlpanel_router_kv_aware_fallbacks_total", model=model,
                  reason="unknown_index") == 5  # fmt: skip
    assert decisions(router, model, "fallback") == 4 and decisions(router, model, "miss") == 1
    wait_until(lambda: checked(router, model, "kv_aware")[0] == 5)


def test_prefix_awares_predictions_are_checked_too(
    router: RouterServer, simulator: StartSimulator, client: openai.OpenAI
) -> None:
    model = "kv-prefix"
    kv_fleet(router, simulator, model, 2, events=False)
    served_models.served_model_set_policy(
        name=model, policy="prefix_aware", policy_config={}, actor="test"
    )
    applied = f'controlpanel_router_model_policy{{model="{model}",policy="prefix_aware"}}'
    wait_until(lambda: applied in router.get("/metrics").text)
    for _ in range(3):
        ask(client, model, [{"role": "system", "content": SYSTEM}])
    # the first prompt is new (0 predicted, 0 cached); the same prompt again is held whole
    wait_until(lambda: checked(router, model, "prefix_aware") == (3.0, 3.0))


# -- the local tokenizer ------------------------------------------------------------------


def patch_tokenizer(router: RouterServer, model: str, folder: str) -> httpx.Response:
    return httpx.patch(
        f"{router.url}/api/models/{model}", json={"tokenizer": folder}, headers=ADMIN_HEADERS
    )


def test_a_local_tokenizer_is_used_off_the_path_and_a_mismatch_with_the_worker_shows(
    router: RouterServer, simulator: StartSimulator, client: openai.OpenAI, tmp_path: Path
) -> None:
    """The router tokenizes with the model's folder (trained here), not the worker. The
    simulated worker tokenizes by words, so its blocks never match the router's ids: the
    cached tokens it reports for a repeated prompt show up as prediction errors on /metrics,
    which is how an operator sees a tokenizer that is not the engine's."""
    model = "kv-local"
    kv_fleet(router, simulator, model, 1)
    folder = make_tokenizer_folder(tmp_path / "tokenizer")
    answer = patch_tokenizer(router, model, str(folder))
    assert answer.status_code == 200, answer.text
    assert answer.json()["tokenizer"] == str(folder)
    use_kv_aware(router, model)
    local = {"model": model, "outcome": "local"}

    def tokenized_here() -> bool:
        ask(client, model, [{"role": "system", "content": SYSTEM}])
        return metric(router, "controlpanel_router_tokenize_requests_total", **local) >= 1

    wait_until(tokenized_here)  # the folder loads on a thread, then is used
    before = checked(router, model, "kv_aware")[0]
    assert ask(client, model, [{"role": "system", "content": SYSTEM}]) >= 15 * 16
    wait_until(lambda: checked(router, model, "kv_aware")[0] == before + 1)
    count, within = checked(router, model, "kv_aware")
    assert within < count  # the worker had it cached; the router's ids said it could not
    assert metric(router, "controlpanel_router_tokenize_seconds_count", model=model,
                  source="local") >= 2  # fmt: skip
    # the admin dry run tokenizes locally too (it sends nothing to a worker)
    body = {"model": model, "messages": [{"role": "system", "content": SYSTEM}]}
    told = router.post("/api/route/explain", json=body, headers=ADMIN_HEADERS).json()
    assert told["dry_run"] is True and told["policy"] == "kv_aware"
    (only,) = told["candidates"]
    assert only["source"] == "events" and only["cached_tokens"] == 0 < only["prompt_tokens"]


def test_a_local_tokenizer_that_agrees_with_the_engine_routes_exactly_without_a_hop(
    router: RouterServer, simulator: StartSimulator, client: openai.OpenAI, tmp_path: Path
) -> None:
    """The same folder (trained here) on the router and on the simulated engines: the
    router's ids are the engine's, so the index matches them with no /tokenize hop."""
    model = "kv-same-tokenizer"
    folder = make_tokenizer_folder(tmp_path / "tokenizer")
    sims, workers = kv_fleet(router, simulator, model, 2, tokenizer=str(folder))
    assert patch_tokenizer(router, model, str(folder)).status_code == 200
    use_kv_aware(router, model)
    local = {"model": model, "outcome": "local"}
    system = [{"role": "system", "content": SYSTEM}]
    tokenized = "controlpanel_router_tokenize_requests_total"

    def tokenized_here() -> bool:
        ask(client, model, system)
        return metric(router, tokenized, **local) >= 1

    wait_until(tokenized_here)  # the folder loads on a thread, then is used
    assert router.get("/health").json()["tokenizers"] == {str(folder): "loaded"}
    holder = workers[max(range(2), key=lambda i: served(sims)[i])]
    hops = metric(router, tokenized, model=model, outcome="worker")
    before, (count, within) = served(sims), checked(router, model, "kv_aware")
    for turn in range(1, 5):
        reported, prompt = usage(client, model, conversation(turn))
        assert reported > 0
        wait_until(lambda p=prompt: indexed_blocks(router, holder) >= p // 16)
    gained = [after - b for after, b in zip(served(sims), before, strict=True)]
    assert gained[workers.index(holder)] == 4 and sum(gained) == 4
    assert decisions(router, model, "kv") >= 4
    wait_until(lambda: checked(router, model, "kv_aware") == (count + 4, within + 4))
    assert metric(router, tokenized, model=model, outcome="worker") == hops  # no hop since


def test_a_template_in_chat_template_jinja_tokenizes_chat_here_with_no_hop(
    router: RouterServer, simulator: StartSimulator, client: openai.OpenAI, tmp_path: Path
) -> None:
    """The router's folder keeps its template in chat_template.jinja, as current Hugging Face
    folders do; the engines get the same tokenizer with the template in its config (the
    simulator reads that layout). Once /health says the folder is loaded with its template,
    no chat request costs a /tokenize hop: none reaches any worker, and the router counts
    every one as tokenized here."""
    model = "kv-jinja"
    folder = make_tokenizer_folder(tmp_path / "router", template_in="jinja")
    assert not config_of(folder).get("chat_template")
    engine = tmp_path / "engine"
    engine.mkdir()
    shutil.copy(folder / "tokenizer.json", engine / "tokenizer.json")
    config = config_of(folder) | {"chat_template": (folder / "chat_template.jinja").read_text()}
    (engine / "tokenizer_config.json").write_text(json.dumps(config))
    sims, _ = kv_fleet(router, simulator, model, 2, tokenizer=str(engine))
    assert patch_tokenizer(router, model, str(folder)).status_code == 200
    use_kv_aware(router, model)
    wait_until(lambda: router.get("/health").json()["tokenizers"] == {str(folder): "loaded"})
    tokenized = "controlpanel_router_tokenize_requests_total"
    before = metric(router, tokenized, model=model, outcome="local")
    for turn in range(1, 5):
        reported, prompt = usage(client, model, conversation(turn))
        assert prompt > 0 and (turn == 1 or reported > 0)  # the engine saw the same ids
    assert [sim.state.by_path["/tokenize"] for sim in sims] == [0, 0]
    assert metric(router, tokenized, model=model, outcome="worker") == 0
    assert metric(router, tokenized, model=model, outcome="local") == before + 4


def config_of(folder: Path) -> dict[str, Any]:
    config: dict[str, Any] = orjson.loads((folder / "tokenizer_config.json").read_bytes())
    return config


def test_a_tokenizer_folder_is_checked_when_it_is_set(
    router: RouterServer, simulator: StartSimulator, tmp_path: Path
) -> None:
    model = "kv-folder"
    kv_fleet(router, simulator, model, 1, events=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    for folder, why in [
        (str(tmp_path / "missing"), "no such folder"),
        (str(tmp_path), "no tokenizer.json"),
        ("relative/folder", "absolute path"),
        (str(broken), "cannot be used"),
    ]:
        answer = patch_tokenizer(router, model, folder)
        assert answer.status_code == 422, answer.text
        assert why in answer.json()["error"]["message"]
    good = make_tokenizer_folder(tmp_path / "good")
    assert patch_tokenizer(router, model, str(good)).json()["tokenizer"] == str(good)
    cleared = patch_tokenizer(router, model, "")
    assert cleared.status_code == 200 and cleared.json()["tokenizer"] == ""
