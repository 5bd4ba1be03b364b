"""kv_aware and its request tokens: pure unit tests (no DB; no I/O but the tokenizer folder).

The exact index is the real one (routing.kv.kv_index), fed the way its subscriber feeds it;
the tokenizer is trained here (harness.tokenizer_folder) and read back by
routing.prompt.tokenize."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.common.workers import worker_view
from controlpanel.fleet.served_models import policy_knobs
from harness.tokenizer_folder import make_tokenizer_folder, rendered_chat
from routing.fleet.snapshot import ModelEntry, ServedModelInfo, build_snapshot
from routing.kv.kv_index import KvIndex
from routing.policies import make_policy
from routing.policies.base import Prediction
from routing.policies.kv_aware import KvAwarePolicy
from routing.prompt.tokenize import (
    CHAT_PATH,
    LocalTokenizer,
    RequestTokens,
    TokenizerFolderError,
    check_folder,
)
from routing.telemetry.cache_check import predicted_tokens
from tests.support.kv_aware import BLOCK, ask, decide, fleet, holds, indexed, make, request, tokens

# -- the cost rule, on the exact index ------------------------------------------------------


def test_the_worker_holding_the_prompt_wins_while_loads_are_level() -> None:
    policy, workers, index = indexed(3, empty=(0, 2))
    prompt = tokens(1, 40 * BLOCK)
    holds(index, 1, prompt[: 30 * BLOCK])
    chosen = Counter(ask(policy, workers, request([*prompt, i])).id for i in range(20))
    assert chosen == {1: 20}
    assert policy.decisions == {"kv": 20}
    assert policy.fallbacks == {}


def test_a_request_in_flight_costs_load_weight_blocks() -> None:
    policy, workers, index = indexed(2, empty=(0,), load_weight=8)
    prompt = tokens(1, 40 * BLOCK)
    holds(index, 1, prompt[: 10 * BLOCK])  # saves 10 blocks of prefill
    assert ask(policy, workers, request(prompt), {0: 0, 1: 1}).id == 1  # 30 + 8 < 40
    assert ask(policy, workers, request(prompt), {0: 0, 1: 2}).id == 0  # 30 + 16 > 40
    costs = {
        c["worker"]: c["cost"] for c in policy.explain(workers, request(prompt), {1: 2}).candidates
    }
    assert costs == {"w0": 40.0, "w1": 46.0}


def test_overlap_weight_scales_the_prefill_side() -> None:
    policy, workers, index = indexed(2, empty=(0,), overlap_weight=0.5, load_weight=8)
    prompt = tokens(1, 40 * BLOCK)
    holds(index, 1, prompt[: 10 * BLOCK])
    # 0.5 * 30 + 8 = 23 > 0.5 * 40 = 20: a cheap prefill is not worth a queue
    assert ask(policy, workers, request(prompt), {1: 1}).id == 0


def test_a_hot_prefix_spills_past_the_guard_as_prefix_aware_does() -> None:
    policy, workers, index = indexed(3, empty=(0, 2), load_weight=0, balance_abs_threshold=4)
    prompt = tokens(1, 40 * BLOCK)
    holds(index, 1, prompt)
    loads = {0: 1, 1: 6, 2: 0}
    choice = decide(policy, workers, request(prompt), loads)
    assert choice.worker.id == 2  # 6 - 0 > 4 and 6 > 1.1 * 0
    assert choice.decision == "load"
    assert ask(policy, workers, request(prompt), {0: 1, 1: 4, 2: 0}).id == 1  # 4 - 0 is not > 4
    assert policy.decisions == {"load": 1, "kv": 1}


def test_a_prompt_nobody_holds_goes_to_the_least_loaded_in_order_of_load() -> None:
    policy, workers, _ = indexed(3, empty=(0, 1, 2))
    loads = {0: 10, 1: 5, 2: 0}
    chosen = Counter(ask(policy, workers, request(tokens(i, 64)), loads).id for i in range(10))
    assert chosen == {2: 10}
    assert policy.decisions == {"miss": 10}


def test_lora_blocks_only_match_the_adapter() -> None:
    lora = (ModelEntry("m"), ModelEntry("m-lora", parent="m"))
    policy, index = make(), KvIndex()
    policy.kv_index = index
    workers = [worker_view(i, models=lora) for i in range(2)]
    index.clear(0)
    prompt = tokens(1, 20 * BLOCK)
    holds(index, 1, prompt, lora="m-lora")
    choice = decide(policy, workers, request(prompt, model="m-lora"))
    assert choice.worker.id == 1
    assert choice.decision == "kv"
    choice = decide(policy, workers, request(prompt, model="m"))
    assert choice.worker.id in (0, 1)
    assert choice.decision == "miss"  # the base model holds none of it


def test_the_prediction_is_whole_blocks_short_of_the_last_token() -> None:
    policy, workers, index = indexed(2, empty=(0,))
    prompt = tokens(1, 40 * BLOCK)
    holds(index, 1, prompt)
    choice = decide(policy, workers, request(prompt))
    assert choice.prediction is not None
    assert choice.prediction.tokens == 39 * BLOCK  # vLLM recomputes the last token
    choice = decide(policy, workers, request([*prompt, *tokens(2, 7)]))
    assert choice.prediction.tokens == 40 * BLOCK
    assert choice.prediction.worker_id == 1


def test_replicas_with_the_same_index_make_the_same_decisions() -> None:
    index = KvIndex()
    one, two = make(), KvAwarePolicy(rng=random.Random(99))
    one.kv_index = two.kv_index = index
    workers = fleet(4)
    for worker_id in range(4):
        holds(index, worker_id, tokens(worker_id, (worker_id + 1) * 8 * BLOCK))
    for i in range(4):
        prompt = request([*tokens(i, 40 * BLOCK), 7])
        loads = {w: (w * 3 + i) % 5 for w in range(4)}
        assert ask(one, workers, prompt, loads).id == ask(two, workers, prompt, loads).id


# -- an index that cannot be trusted: the approximate one, counted ---------------------------


def test_an_unknown_worker_is_scored_on_the_approximate_index() -> None:
    policy, workers, _ = indexed(2, empty=(0,))
    prompt = tokens(1, 40 * BLOCK)
    choice = decide(policy, workers, request(prompt), {0: 1, 1: 0})
    first = choice.worker  # w1 unknown, cold: lighter
    assert first.id == 1 and choice.decision == "miss"
    assert policy.fallbacks == {"unknown_index": 1}
    choice = decide(policy, workers, request([*prompt, 5]))
    assert choice.worker.id == 1  # remembered approximately
    assert choice.decision == "fallback"
    sources = {
        c["worker"]: c["source"] for c in policy.explain(workers, request(prompt), {}).candidates
    }
    assert sources == {"w0": "events", "w1": "approximate"}


def test_a_gap_makes_a_worker_unknown_never_trusted_stale() -> None:
    policy, workers, index = indexed(2, empty=(0,))
    prompt = tokens(1, 40 * BLOCK)
    holds(index, 1, prompt)
    choice = decide(policy, workers, request(prompt))
    assert choice.worker.id == 1 and choice.decision == "kv"
    index.check_sequence(1, 57)  # batches were missed
    ask(policy, workers, request(prompt))
    assert policy.fallbacks == {"unknown_index": 1}
    told = policy.explain(workers, request(prompt), {})
    assert {c["worker"]: c["source"] for c in told.candidates} == {
        "w0": "events", "w1": "approximate"
    }  # fmt: skip


# -- explaining ------------------------------------------------------------------------------


def test_each_worker_is_counted_in_its_own_block_size_by_one_walk_per_size() -> None:
    """Workers of block size 16 and 8, an empty trusted one and an unknown one, scored
    together: each exact count in its own size, as a per-worker lookup gives it."""
    policy, workers, index = indexed(4, empty=[2])
    ids = tokens(1, 100)
    holds(index, 0, ids[:64])  # 4 blocks of 16
    index.check_sequence(1, 0)
    index.store(1, list(range(900, 906)), None, ids[:48], 8, None)  # 6 blocks of 8
    rows = {row["worker"]: row for row in policy.explain(workers, request(ids), {}).candidates}
    assert [rows[w.name]["cached_tokens"] for w in workers[:3]] == [64, 48, 0]
    assert [rows[w.name]["block_size"] for w in workers[:3]] == [BLOCK, 8, BLOCK]
    assert rows[workers[3].name]["source"] == "approximate"
    assert index.cached_blocks(0, ids) == 4 and index.cached_blocks(1, ids) == 6


def test_explain_agrees_with_select_and_changes_nothing() -> None:
    policy, workers, index = indexed(3, empty=(0, 2))
    prompt = tokens(1, 40 * BLOCK)
    holds(index, 1, prompt[: 24 * BLOCK])
    told = policy.explain(workers, request(prompt), {1: 1})
    assert policy.decisions == {} and policy.approximate.entries == 0
    assert told.decision == "kv" and told.worker is not None and told.worker.id == 1
    assert told.candidates[0] == {
        "worker": "w1", "cached_tokens": 24 * BLOCK, "prompt_tokens": 40 * BLOCK,
        "block_size": BLOCK, "source": "events", "load": 1, "cost": 24.0,
    }  # fmt: skip
    assert [c["worker"] for c in told.candidates[1:]] == ["w0", "w2"]
    assert ask(policy, workers, request(prompt), {1: 1}).id == told.worker.id


def test_explain_of_a_request_without_tokens_says_why() -> None:
    policy, workers = make(), fleet(2)
    told = policy.explain(workers, request(None, "some text"), {})
    assert told.decision == "fallback"
    assert {c["fallback"] for c in told.candidates} == {"no_tokens"}
    assert policy.fallbacks == {}


# -- without an exact index: prefix_aware's approximate index, counted ----------------------


def test_without_an_index_every_worker_falls_back_and_the_approximate_index_learns() -> None:
    policy, workers = make(), fleet(3)
    prompt = tokens(1, 40 * BLOCK)
    first = ask(policy, workers, request(prompt))
    assert policy.decisions == {"miss": 1}  # nobody holds anything yet: least loaded
    assert policy.fallbacks == {"unknown_index": 1}
    for i in range(5):  # the same prompt, plus a tail: the approximate index found it
        again = request([*prompt, *tokens(9, i + 1)])
        assert ask(policy, workers, again).id == first.id
    assert policy.decisions == {"miss": 1, "fallback": 5}
    assert policy.fallbacks == {"unknown_index": 6}
    assert policy.approximate.tree_size(first.id) > 0


def test_a_request_without_tokens_is_routed_by_prefix_awares_rule() -> None:
    policy, workers = make(), fleet(3)
    text = " ".join(f"w{i}" for i in range(600))
    first = ask(policy, workers, request(None, text))
    choice = decide(policy, workers, request(None, text + " more"))
    assert choice.worker.id == first.id
    assert policy.decisions == {"fallback": 2}
    assert policy.fallbacks == {"no_tokens": 2}
    assert choice.prediction is not None and choice.prediction.tokens is None


# -- knobs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        {"overlap_wieght": 1},  # misspelt
        {"overlap_weight": -1},
        {"load_weight": "8"},
        {"balance_rel_threshold": 0.5},
        {"block_size": 0},
        {"block_size": 2.5},
        {"balance_abs_threshold": True},
    ],
)
def test_bad_knobs_are_refused(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="kv_aware"):
        KvAwarePolicy(config)


def test_an_unbuildable_config_falls_back_to_the_default_policy_loudly() -> None:
    assert make_policy("kv_aware", {"block_size": 0}).name == "shortest_queue"


def test_the_control_planes_hint_lists_every_knob_with_its_default() -> None:
    knobs = policy_knobs("kv_aware")
    assert sorted(knobs["keys"]) == sorted(
        ["overlap_weight", "load_weight", "balance_abs_threshold", "balance_rel_threshold",
         "block_size", "pending_seconds", "miss_spread"]
    )  # fmt: skip
    assert json.loads(knobs["example"]) == {
        "overlap_weight": 1.0, "load_weight": 8, "balance_abs_threshold": 32,
        "balance_rel_threshold": 1.1, "block_size": 16, "pending_seconds": 10.0,
        "miss_spread": 0,
    }  # fmt: skip


# -- predictions ------------------------------------------------------------------------------


def test_predictions_in_tokens_and_from_a_share() -> None:
    info = request([1, 2, 3])
    assert predicted_tokens(Prediction(info, 1, 48, 0.5), 100) == 48
    # prefix_aware's share of the reported prompt, in whole blocks of 16
    assert predicted_tokens(Prediction(info, 1, None, 0.5), 100) == 48
    assert predicted_tokens(Prediction(info, 1, None, 1.0), 64) == 64
    assert predicted_tokens(Prediction(info, 1, None, 0.9), None) == 0


# -- the local tokenizer ------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_folder(tmp_path_factory.mktemp("tok") / "tokenizer")


def test_chat_is_rendered_with_the_template_and_encoded_without_adding_specials(
    folder: Path,
) -> None:
    local = LocalTokenizer(str(folder))
    messages = [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "  tell me about the lazy dog  "},
    ]
    expected = local.tokenizer.encode(rendered_chat(messages), add_special_tokens=False).ids
    assert local.chat({"messages": messages}) == expected
    assert expected[0] == local.tokenizer.token_to_id("<s>")  # the template's bos_token
    without = rendered_chat(messages, generation_prompt=False)
    ids = local.chat({"messages": messages, "add_generation_prompt": False})
    assert ids == local.tokenizer.encode(without, add_special_tokens=False).ids
    parts = [{"type": "text", "text": "tell me"}, {"type": "text", "text": "about the dog"}]
    joined = [{"role": "user", "content": "tell me\nabout the dog"}]
    assert local.chat({"messages": [{"role": "user", "content": parts}]}) == local.chat(
        {"messages": joined}
    )


def test_what_cannot_be_tokenized_exactly_here_gives_none(folder: Path) -> None:
    local = LocalTokenizer(str(folder))
    image = [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]
    assert local.chat({"messages": [{"role": "user", "content": image}]}) is None
    # the template's raise_exception: the worker would answer the error, not us
    assert local.chat({"messages": [{"role": "tool", "content": "42"}]}) is None
    assert (
        local.chat({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"})
        is None
    )
    assert local.chat({"messages": "not a list"}) is None


def test_a_completion_prompt_gets_the_tokenizers_own_specials(folder: Path) -> None:
    local = LocalTokenizer(str(folder))
    ids = local.prompt("the quick brown fox", {})
    assert ids == local.tokenizer.encode("the quick brown fox", add_special_tokens=True).ids
    assert ids[0] == local.tokenizer.token_to_id("<s>")
    assert local.prompt("the quick brown fox", {"add_special_tokens": False}) == ids[1:]


def test_a_folder_without_a_chat_template_tokenizes_prompts_only(tmp_path: Path) -> None:
    local = LocalTokenizer(str(make_tokenizer_folder(tmp_path / "t", chat_template=None)))
    assert local.chat({"messages": [{"role": "user", "content": "hi"}]}) is None
    assert local.prompt("hi", {})


def test_a_long_chat_is_encoded_off_the_loop_to_the_same_ids(folder: Path) -> None:
    tokens = RequestTokens()
    model = ServedModelInfo("m", policy="kv_aware", tokenizer=str(folder))
    snapshot = build_snapshot(workers=(), served_models=[model], generation=1)
    tokens.install(snapshot)  # no event loop here: loaded at once
    long = "tell me about the quick brown fox " * 400  # past INLINE_CHARS: on the thread
    body = {"model": "m", "messages": [{"role": "user", "content": long}]}

    async def tokenize() -> list[int] | None:
        async with aiohttp.ClientSession() as session:
            return await tokens.of(session, CHAT_PATH, snapshot.routes["m"], body, (), {})

    try:
        assert asyncio.run(tokenize()) == LocalTokenizer(str(folder)).chat(body)
    finally:
        tokens.close()
    assert tokens.outcomes == {("m", "local"): 1}


def test_folders_are_checked(tmp_path: Path, folder: Path) -> None:
    assert check_folder(str(folder)) == folder
    for bad, why in [
        ("relative/path", "absolute"),
        (str(tmp_path / "missing"), "no such folder"),
        (str(tmp_path), "no tokenizer.json"),
    ]:
        with pytest.raises(TokenizerFolderError, match=why):
            check_folder(bad)
