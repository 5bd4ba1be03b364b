"""Tokenizer folders made offline: the small BPE with its chat template in each of the
three places a folder keeps one, the trained and the one-token-per-word folders, and the
hand-written rendering of the template that tests hold the router to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from harness import tokenizer_folder as tf

MESSAGES = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "hi"}]


def render(template: str, **context: object) -> str:
    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(bos_token="<s>", **context)


def test_the_small_bpe_puts_bos_in_front_and_round_trips(tmp_path: Path) -> None:
    folder = tf.make_tokenizer_folder(tmp_path / "tok")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encoded = tokenizer.encode("the quick brown fox")
    assert encoded.tokens[0] == "<s>"
    assert tokenizer.decode(encoded.ids) == "the quick brown fox"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tf.CHAT_TEMPLATE and config["eos_token"] == "</s>"


@pytest.mark.parametrize("where", ["jinja", "json"])
def test_the_template_goes_where_asked(tmp_path: Path, where: str) -> None:
    folder = tf.make_tokenizer_folder(tmp_path, template_in=where)
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    if where == "jinja":
        assert (folder / "chat_template.jinja").read_text() == tf.CHAT_TEMPLATE
    else:
        kept = json.loads((folder / "chat_template.json").read_text())
        assert kept == {"chat_template": tf.CHAT_TEMPLATE}


def test_an_unknown_place_is_refused_and_none_writes_no_template(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="template_in"):
        tf.make_tokenizer_folder(tmp_path / "a", template_in="yaml")
    folder = tf.make_tokenizer_folder(tmp_path / "b", chat_template=None)
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())


def test_the_hand_written_rendering_is_what_the_template_renders() -> None:
    for prompt in (True, False):
        expected = tf.rendered_chat(MESSAGES, generation_prompt=prompt)
        assert render(tf.CHAT_TEMPLATE, messages=MESSAGES, add_generation_prompt=prompt) == expected
    assert tf.rendered_chat(MESSAGES).endswith("<|user|>\nhi<|end|>\n<|assistant|>\n")
    with pytest.raises(ValueError, match="Only system, user and assistant"):
        render(tf.CHAT_TEMPLATE, messages=[{"role": "tool", "content": "x"}])


def test_the_word_folder_makes_one_token_per_word(tmp_path: Path) -> None:
    words = ["alpha", "beta", "gamma"]
    folder = tf.build_word_tokenizer_folder(tmp_path, words)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.encode("alpha gamma beta alpha").tokens == ["alpha", "gamma", "beta", "alpha"]
    assert tokenizer.encode("delta").tokens == ["<unk>"]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tf.PLAIN_TEMPLATE


def test_the_trained_folder_knows_its_vocabulary(tmp_path: Path) -> None:
    folder = tf.build_tokenizer_folder(tmp_path, ["router", "prefix", "cache"], vocab_size=300)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.encode("router cache").tokens == ["router", "cache"]
