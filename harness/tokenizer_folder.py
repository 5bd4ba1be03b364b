"""Hugging Face tokenizer folders made here with the `tokenizers` library (nothing is
downloaded): ``tokenizer.json`` plus ``tokenizer_config.json`` with a chat template. The router
loads one as a served model's ``tokenizer`` (``routing.prompt.tokenize.LocalTokenizer``) and
the simulated workers with ``--tokenizer``, so both make the same ids, as one model's tokenizer
does on the router and on every vLLM worker.

* :func:`make_tokenizer_folder`: a small BPE (Metaspace, ``<s>`` put in front of a plain
  prompt by its post-processor) with a chat template in the style of the public models'
  (special tokens, ``trim``, ``raise_exception``), the template in any of the three places a
  folder keeps it; :func:`rendered_chat` writes out by hand what that template renders.
* :func:`build_tokenizer_folder`: a BPE trained on a benchmark's own vocabulary, with
  :data:`PLAIN_TEMPLATE`.
* :func:`build_word_tokenizer_folder`: one token per word, as the simulator's own word
  tokenizer counts them, so a workload sized in words keeps its size in tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only system, user and assistant roles are supported') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n"
    "{{ message['content'] | trim }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "seven wizards quietly hum a lively tune about packing boxes",
    "a router sends each prompt where its prefix is cached",
    "you are a helpful assistant answer briefly and precisely",
    "tell me about the history of the printing press in europe",
]


def make_tokenizer_folder(
    folder: Path, *, chat_template: str | None = CHAT_TEMPLATE, template_in: str = "config"
) -> Path:
    """Train a small BPE tokenizer on CORPUS and save it as a Hugging Face folder; returns
    `folder`. The chat template goes where `template_in` says: "config"
    (tokenizer_config.json's field, the old layout), "jinja" (chat_template.jinja, what
    transformers writes now) or "json" (chat_template.json, the processors' legacy file)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, min_frequency=1)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {
        "bos_token": {"content": "<s>", "lstrip": False, "rstrip": False},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None and template_in == "config":
        config["chat_template"] = chat_template
    elif chat_template is not None and template_in == "jinja":
        (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    elif chat_template is not None and template_in == "json":
        text = json.dumps({"chat_template": chat_template})
        (folder / "chat_template.json").write_text(text, encoding="utf-8")
    elif chat_template is not None:
        raise ValueError(f"template_in: config, jinja or json, not {template_in!r}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def rendered_chat(messages: list[dict[str, str]], *, generation_prompt: bool = True) -> str:
    """What CHAT_TEMPLATE renders, written out by hand (a test's independent truth)."""
    text = "<s>"
    for message in messages:
        text += f"<|{message['role']}|>\n{message['content'].strip()}<|end|>\n"
    return text + ("<|assistant|>\n" if generation_prompt else "")


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
    _plain_config(root)
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
    _plain_config(root)
    return root


def _plain_config(root: Path) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": PLAIN_TEMPLATE}
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
