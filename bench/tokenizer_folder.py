"""Hugging Face tokenizer folders for the benchmarks, made here with the `tokenizers` library
(nothing is downloaded): BPE trained on the bench's own vocabulary, or one token per word,
saved as tokenizer.json plus tokenizer_config.json with a chat template. The
router loads it as a served model's ``tokenizer`` (routing.tokenize.LocalTokenizer) and the
simulated workers with ``--tokenizer``, so both make the same ids, as one model's tokenizer
does on the router and on every vLLM worker."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def build_tokenizer_folder(root: Path, vocabulary: list[str], vocab_size: int = 2000) -> Path:
    """Train on sentences drawn from `vocabulary` and save the folder in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False
    )
    rng = random.Random(1)
    corpus = (" ".join(rng.choices(vocabulary, k=50)) for _ in range(2000))
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return root


def build_word_tokenizer_folder(root: Path, words: list[str]) -> Path:
    """One token per word of `words` (a word-level model), as the simulator's own word
    tokenizer counts them, so a workload sized in words keeps its size in tokens."""
    root.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(dict.fromkeys([*SPECIALS, *words]))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(root / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return root
