"""kv_aware on real vLLM's KV cache events: the router decodes every batch vLLM 0.32 sends,
trusts the index it builds, learns each engine's block size, follows evictions, rebuilds
from the replay socket after its own restart and after the engine's, and predicts the cached
tokens vLLM itself reports (usage.prompt_tokens_details.cached_tokens) on every turn of a
conversation. Numbers come from the router's /metrics and /list_workers and from vLLM's own
answers, never from the code under test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from controlpanel.fleet import served_models
from controlpanel.registry.models import Worker
from tests.realvllm.fleet import (
    PATIENCE_S,
    kv_status,
    quiet,
    register,
    router_metric,
    use_policy,
)
from tests.realvllm.servers import BLOCK_SIZE, CACHE_BLOCKS, MODEL, RealWorker
from tests.support.servers import RouterServer, start_router, stop_process, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def system(tag: str) -> str:
    """A system prompt of about 8 blocks of 32 tokens that no other test sends (the engines
    live through the whole session, their caches too)."""
    return f"[{tag}] " + " ".join(f"Rule {i}: be brief." for i in range(40))


def blocks(router: RouterServer, worker: Worker) -> int:
    index = kv_status(router, worker).get("index")
    return 0 if index is None else int(index["blocks"])


def trust(router: RouterServer, worker: Worker) -> str | None:
    """The index's trust, None while the stream has no index yet (nothing received)."""
    index = kv_status(router, worker).get("index")
    return None if index is None else str(index["trust"])


def cache_numbers(router: RouterServer) -> tuple[float, float, float, float]:
    """(checked, within one block, predicted tokens, reported tokens) for kv_aware."""
    labels = {"model": MODEL, "policy": "kv_aware"}
    return (
        router_metric(router, "controlpanel_router_cache_prediction_error_tokens_count", **labels),
        router_metric(router, "controlpanel_router_cache_predictions_within_block_total", **labels),
        router_metric(router, "controlpanel_router_cache_predicted_tokens_total", **labels),
        router_metric(router, "controlpanel_router_cache_reported_tokens_total", **labels),
    )


def decisions(router: RouterServer) -> dict[str, float]:
    name = "controlpanel_router_policy_decisions_total"
    return {
        kind: router_metric(router, name, model=MODEL, decision=kind)
        for kind in ("kv", "pending", "miss", "fallback", "load")
    }


def chat(
    client: openai.OpenAI,
    messages: list[dict[str, str]],
    max_tokens: int = 40,
    request_id: str = "",
) -> tuple[str, int]:
    """One turn: (the answer's text, the cached tokens vLLM reported)."""
    answer = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        extra_headers={"X-Request-ID": request_id} if request_id else None,
    )
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return answer.choices[0].message.content or "", cached


def test_every_batch_decodes_the_index_is_trusted_and_the_block_size_learned(
    router: RouterServer, client: openai.OpenAI, vllm_pair: list[RealWorker]
) -> None:
    workers = register(router, vllm_pair)
    chat(
        client, [{"role": "system", "content": system("decode")}, {"role": "user", "content": "hi"}]
    )
    served = [w for w in workers if kv_status(router, w)["events"] or blocks(router, w)]
    wait_until(lambda: any(blocks(router, w) for w in workers), timeout=PATIENCE_S)
    for worker in workers:
        status = kv_status(router, worker)
        assert status["connected"] and status["malformed"] == 0 and status["errors"] == 0
        assert status["index"]["trust"] == "ready"
        assert status["replays"].get("failed", 0) == 0
    assert served, "some worker's events were applied"
    for worker in served:
        assert kv_status(router, worker)["index"]["block_size"] == BLOCK_SIZE
    name = "controlpanel_router_kv_events_malformed_total"
    assert sum(router_metric(router, name, worker=w.name) for w in workers) == 0


@pytest.mark.parametrize(
    ("policy_config", "local"),
    [({}, False), ({"pending_seconds": 0}, False), ({}, True)],
    ids=["credit", "events", "local-tokenizer"],
)
def test_each_turn_after_the_first_is_decided_from_events_and_predicted_exactly(
    router: RouterServer,
    client: openai.OpenAI,
    vllm_pair: list[RealWorker],
    tiny_folder: Path,
    policy_config: dict[str, float],
    local: bool,
) -> None:
    """Tokens from the worker's /tokenize, or (local) from the model's own folder, whose
    chat template is in chat_template.jinja as transformers writes it today: then no hop."""
    workers = register(router, vllm_pair)
    use_policy(router, "kv_aware", **policy_config)
    if local:
        use_tokenizer(router, tiny_folder)
    tokenized_before = tokenized(router)
    messages = [{"role": "system", "content": system(f"turns {policy_config} {local}")}]
    reported = []
    # The router lives through the session: its counters are read as differences.
    start, made_before = cache_numbers(router), decisions(router)
    fallbacks = "controlpanel_router_kv_aware_fallbacks_total"
    fallbacks_before = router_metric(router, fallbacks, model=MODEL)
    for turn in range(6):
        for worker in workers:
            quiet(router, worker)  # the last answer's blocks are in the index
        before = cache_numbers(router)
        messages.append({"role": "user", "content": f"Question {turn}: what comes next?"})
        rid = f"turn-{turn}-{'local' if local else 'hop'}-{policy_config.get('pending_seconds')}"
        text, cached = chat(client, messages, request_id=rid)
        messages.append({"role": "assistant", "content": text})
        reported.append(cached)
        wait_until(lambda b=before: cache_numbers(router)[0] == b[0] + 1, timeout=PATIENCE_S)
        after = cache_numbers(router)
        # This turn's prediction, exactly what vLLM said it found in its cache...
        assert after[2] - before[2] == after[3] - before[3] == cached, (turn, before, after)
        # ...and so says the request's own access-log line.
        line = wait_until(lambda r=rid: access_line(router, r), timeout=PATIENCE_S)
        decided = "miss" if turn == 0 else "kv"
        want = {"decision": decided, "predicted": cached, "reported": cached}
        assert line["cache"] == {**want, "block_size": BLOCK_SIZE}, line
    assert reported[0] == 0 and all(c >= 8 * BLOCK_SIZE for c in reported[1:])
    made = {k: v - made_before[k] for k, v in decisions(router).items()}
    assert made["miss"] == 1 and made["kv"] == 5, made
    checked, within, predicted, told = (
        b - a for a, b in zip(start, cache_numbers(router), strict=True)
    )
    assert checked == within == 6 and predicted == told == sum(reported)
    assert router_metric(router, fallbacks, model=MODEL) == fallbacks_before
    hops = {k: v - tokenized_before[k] for k, v in tokenized(router).items()}
    assert hops == ({"local": 6, "worker": 0} if local else {"local": 0, "worker": 6}), hops


def access_line(router: RouterServer, request_id: str) -> dict[str, Any] | None:
    """The router's access-log line of one request, once written."""
    for line in reversed(router.log().splitlines()):
        if line.startswith("{") and request_id in line:
            entry: dict[str, Any] = json.loads(line)
            if entry.get("request_id") == request_id:
                return entry
    return None


def tokenized(router: RouterServer) -> dict[str, float]:
    name = "controlpanel_router_tokenize_requests_total"
    return {o: router_metric(router, name, model=MODEL, outcome=o) for o in ("local", "worker")}


def use_tokenizer(router: RouterServer, folder: Path) -> None:
    """The model's local tokenizer, loaded by the router before this returns."""
    served_models.served_model_set_tokenizer(name=MODEL, tokenizer=str(folder), actor="test")
    wait_until(
        lambda: router.get("/health").json().get("tokenizers", {}).get(str(folder)) == "loaded",
        timeout=PATIENCE_S,
    )


def test_evictions_are_followed(
    router: RouterServer, client: openai.OpenAI, vllm_pair: list[RealWorker]
) -> None:
    workers = register(router, vllm_pair)
    use_policy(router, "kv_aware", pending_seconds=0)
    first = [{"role": "system", "content": system("evict")}, {"role": "user", "content": "Me."}]
    chat(client, first, max_tokens=1)
    holder = max(workers, key=lambda w: blocks(router, w))
    real = vllm_pair[workers.index(holder)]
    held = blocks(router, holder)
    assert held >= 8
    # Fill that engine's 96-block cache with other prompts, straight to it: vLLM evicts the
    # least recently used blocks, the conversation's first, and says so block by block.
    for i in range(5):
        prompt = [1000 + 2000 * i + j for j in range(900)]  # token ids: 28 full blocks
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        httpx.post(f"{real.url}/v1/completions", json=body, timeout=120).raise_for_status()
    quiet(router, holder)
    assert blocks(router, holder) <= CACHE_BLOCKS  # stored and removed, both applied
    before = cache_numbers(router)
    _, cached = chat(client, first, max_tokens=1)
    wait_until(lambda: cache_numbers(router)[0] == before[0] + 1, timeout=PATIENCE_S)
    after = cache_numbers(router)
    assert cached < held * BLOCK_SIZE  # evicted, at least in part
    assert after[2] - before[2] == after[3] - before[3] == cached


def test_a_new_router_rebuilds_every_index_from_the_replay_socket(
    router: RouterServer,
    client: openai.OpenAI,
    vllm_pair: list[RealWorker],
    var_dir: object,
) -> None:
    workers = register(router, vllm_pair)
    chat(
        client, [{"role": "system", "content": system("replay")}, {"role": "user", "content": "x"}]
    )
    for worker in workers:
        quiet(router, worker)
    assert any(blocks(router, w) for w in workers)
    second = start_router(var_dir)  # type: ignore[arg-type]
    try:
        second.wait_routable(*workers)
        for worker in workers:
            wait_until(lambda w=worker: trust(second, w) == "ready", timeout=PATIENCE_S)
            replays, held = kv_status(second, worker)["replays"], blocks(router, worker)
            # An engine that has published nothing answers an empty replay.
            assert replays == ({"complete": 1} if held else {"empty": 1})
            assert kv_status(second, worker)["malformed"] == 0
            assert blocks(second, worker) == held
    finally:
        stop_process(second.proc)


def test_a_restarted_engine_is_seen_and_its_index_starts_over(
    router: RouterServer, client: openai.OpenAI, vllm_pair: list[RealWorker]
) -> None:
    workers = register(router, vllm_pair)
    chat(
        client, [{"role": "system", "content": system("restart")}, {"role": "user", "content": "x"}]
    )
    wait_until(lambda: any(blocks(router, w) for w in workers), timeout=PATIENCE_S)
    restarted, real = workers[0], vllm_pair[0]
    real.server.restart()  # a new engine: empty cache, sequence numbers from 0 again
    status = lambda: kv_status(router, restarted)  # noqa: E731
    wait_until(lambda: status().get("connected") and trust(router, restarted) == "ready",
               timeout=PATIENCE_S)  # fmt: skip
    assert blocks(router, restarted) == 0
    assert status()["malformed"] == 0
    body = {"model": MODEL, "prompt": system("after restart"), "max_tokens": 1}
    httpx.post(f"{real.url}/v1/completions", json=body, timeout=120).raise_for_status()
    wait_until(lambda: blocks(router, restarted) >= 8, timeout=PATIENCE_S)


def test_without_a_tokenizer_folder_tokens_come_from_vllms_render_for_every_route(
    router: RouterServer, client: openai.OpenAI, vllm_pair: list[RealWorker]
) -> None:
    """With --enable-scale-out, one hop to the worker's render route gives the exact engine
    input of chat and of Anthropic's /v1/messages (which /tokenize cannot render): decided
    from events, never the approximate fallback."""
    register(router, vllm_pair)
    use_policy(router, "kv_aware", pending_seconds=0)
    made_before, tokenized_before = decisions(router), tokenized(router)
    fallbacks = "controlpanel_router_kv_aware_fallbacks_total"
    fallbacks_before = router_metric(router, fallbacks, model=MODEL)
    prompt = system("render")
    chat(client, [{"role": "system", "content": prompt}, {"role": "user", "content": "hi"}])
    body = {"model": MODEL, "max_tokens": 4, "system": prompt,
            "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
    for _ in range(2):
        answer = httpx.post(f"{router.url}/v1/messages", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["type"] == "message"
    made = {k: v - made_before[k] for k, v in decisions(router).items()}
    assert made["fallback"] == 0 and made["kv"] + made["miss"] == 3, made
    assert router_metric(router, fallbacks, model=MODEL) == fallbacks_before
    hops = {k: v - tokenized_before[k] for k, v in tokenized(router).items()}
    assert hops == {"local": 0, "worker": 3}
    assert router.get("/health").json()["tokenize_sources"] == {MODEL: "render"}
