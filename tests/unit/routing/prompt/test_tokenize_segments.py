"""Chat prompts encoded from cached pieces (routing.prompt.tokenize_segments) give exactly the ids
of the whole prompt encoded at once, for the tokenizer families of the public models, with
real `tokenizers` tokenizers trained here; tokenizers whose pieces depend on where they
stand keep the cache off, and a mismatch on live traffic turns it off."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from harness.tokenizer_folder import CHAT_TEMPLATE, CORPUS, SPECIALS
from routing.fleet.snapshot import ServedModelInfo, build_snapshot
from routing.prompt.tokenize import CHAT_PATH, LocalTokenizer, RequestTokens, TokenizeCollector
from routing.prompt.tokenize_segments import CHECK_FIRST

WORDS = [*" ".join(CORPUS).split(), "café", "naïve", "x=1;", "\t", "  ", "ünïcödé", "42"]


def folder_with(tmp_path: Path, name: str, tokenizer: Tokenizer, trainer: object) -> str:
    tokenizer.train_from_iterator(CORPUS * 20, trainer)  # type: ignore[arg-type]
    folder = tmp_path / name
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(folder)


def bpe(pre: object, normalizer: object = None) -> tuple[Tokenizer, object]:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre  # type: ignore[assignment]
    if normalizer is not None:
        tokenizer.normalizer = normalizer  # type: ignore[assignment]
    return tokenizer, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS)


FAMILIES: dict[str, Callable[[], tuple[Tokenizer, object]]] = {
    "bpe-whitespace": lambda: bpe(pre_tokenizers.Whitespace()),
    "byte-level": lambda: bpe(pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "byte-level-prefix-space": lambda: bpe(pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "metaspace-always": lambda: bpe(pre_tokenizers.Metaspace(prepend_scheme="always")),
    "nfkc-lowercase": lambda: bpe(
        pre_tokenizers.Whitespace(),
        normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
    ),
    "unigram": lambda: (
        Tokenizer(models.Unigram()),
        trainers.UnigramTrainer(vocab_size=200, special_tokens=SPECIALS, unk_token="<unk>"),
    ),
}


def conversations(rng: random.Random, count: int) -> list[dict[str, object]]:
    """Growing multi-turn chats sharing a system prompt: most pieces come back."""
    system = " ".join(rng.choices(WORDS, k=80))
    bodies: list[dict[str, object]] = []
    messages = [{"role": "system", "content": system}]
    for turn in range(count):
        messages = [*messages, {"role": "user", "content": " ".join(rng.choices(WORDS, k=12))}]
        bodies.append({"messages": messages})
        messages = [*messages, {"role": "assistant", "content": f"answer {turn} café"}]
    return bodies


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pieces_give_exactly_the_whole_prompts_ids(tmp_path: Path, family: str) -> None:
    local = LocalTokenizer(folder_with(tmp_path, family, *FAMILIES[family]()))
    assert local.pieces.off is None, local.pieces.off
    for body in conversations(random.Random(family), 30):
        text = local.render(body)
        assert text is not None
        plan = local.pieces.plan(text)
        assert plan is not None
        ids = local.pieces.join(plan, local.encode_pieces(plan.missing))
        assert ids == local.encode(text, special=False)
    assert local.pieces.counts["hit"] > local.pieces.counts["miss"]  # the cache was used


def test_a_first_only_metaspace_keeps_the_cache_off(tmp_path: Path) -> None:
    family = bpe(pre_tokenizers.Metaspace(prepend_scheme="first"))
    local = LocalTokenizer(folder_with(tmp_path, "first", *family))
    assert local.pieces.off == "its Metaspace pre-tokenizer marks only the text's first piece"
    assert local.pieces.plan("<|user|>\nhi<|end|>\n") is None


def test_an_added_token_that_strips_keeps_the_cache_off(tmp_path: Path) -> None:
    tokenizer, trainer = bpe(pre_tokenizers.Whitespace())
    folder = folder_with(tmp_path, "lstrip", tokenizer, trainer)
    saved = Tokenizer.from_file(f"{folder}/tokenizer.json")
    saved.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    saved.save(f"{folder}/tokenizer.json")
    assert LocalTokenizer(folder).pieces.off == "the added token '<mask>' has lstrip set"


def test_live_checks_compare_and_a_mismatch_turns_the_cache_off(tmp_path: Path) -> None:
    """The router's path: the first prompts are checked against the whole, on its thread."""
    folder = folder_with(tmp_path, "checked", *FAMILIES["bpe-whitespace"]())
    tokens = RequestTokens()
    model = ServedModelInfo("m", policy="kv_aware", tokenizer=folder)
    snapshot = build_snapshot(workers=(), served_models=[model], generation=1)
    tokens.install(snapshot)  # no event loop here: loaded at once
    route = snapshot.routes["m"]
    bodies = conversations(random.Random(1), CHECK_FIRST)

    async def scenario() -> list[list[int] | None]:
        got = [await tokens.of(None, CHAT_PATH, route, b, (), {}) for b in bodies]  # type: ignore[arg-type]
        await asyncio.get_running_loop().run_in_executor(tokens._encoder, lambda: None)
        return got

    local = tokens.loaded()[folder]
    got = asyncio.run(scenario())
    assert got == [local.encode(local.render(b) or "", special=False) for b in bodies]
    assert local.pieces.counts["check_match"] == CHECK_FIRST
    text = local.render(bodies[0]) or ""
    local.pieces.check(local.tokenizer, text, [0])  # as if the pieces had disagreed
    assert local.pieces.off is not None and local.pieces.plan(text) is None
    metrics = {
        (s.labels["outcome"], s.value)
        for family in TokenizeCollector(tokens).collect()
        for s in family.samples
        if s.name == "controlpanel_router_tokenizer_pieces_total"
    }
    assert ("check_mismatch", 1.0) in metrics and ("check_match", CHECK_FIRST) in metrics
    tokens.close()
