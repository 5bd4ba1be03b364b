"""simulator.hf_tokenizer: a Hugging Face folder used as vLLM uses it (chat template rendered,
special tokens as vLLM adds them), the template found where the router finds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from harness.tokenizer_folder import make_tokenizer_folder, rendered_chat
from simulator.hf_tokenizer import HfTokenizer
from simulator.wire import ApiError

MESSAGES = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "hello"}]


def truth(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_a_chat_is_the_rendered_template_encoded_without_added_specials(tmp_path: Path) -> None:
    folder = make_tokenizer_folder(tmp_path / "tok")
    tok, ids_of = HfTokenizer(str(folder)), truth(folder)
    expected = ids_of.encode(rendered_chat(MESSAGES), add_special_tokens=False).ids
    assert tok.chat({"messages": MESSAGES}) == expected
    bare = rendered_chat(MESSAGES, generation_prompt=False)
    assert (
        tok.chat({"messages": MESSAGES, "add_generation_prompt": False})
        == ids_of.encode(bare, add_special_tokens=False).ids
    )
    with_specials = tok.chat({"messages": MESSAGES, "add_special_tokens": True})
    assert with_specials[0] == ids_of.token_to_id("<s>") and with_specials[1:] == expected


def test_a_prompt_gets_the_special_tokens_unless_told_not_to(tmp_path: Path) -> None:
    folder = make_tokenizer_folder(tmp_path / "tok")
    tok = HfTokenizer(str(folder))
    bos = truth(folder).token_to_id("<s>")
    plain = tok.prompt("the quick brown fox", {})
    assert plain[0] == bos
    assert tok.prompt("the quick brown fox", {"add_special_tokens": False}) == plain[1:]
    assert tok.decode(plain[1:]) == "the quick brown fox"


def test_a_template_that_raises_or_is_missing_is_vllms_400(tmp_path: Path) -> None:
    tok = HfTokenizer(str(make_tokenizer_folder(tmp_path / "tok")))
    with pytest.raises(ApiError, match="Only system, user and assistant") as caught:
        tok.chat({"messages": [{"role": "tool", "content": "x"}]})
    assert (caught.value.status, caught.value.param) == (400, "messages")
    with pytest.raises(ApiError):
        tok.chat({"messages": []})
    none = HfTokenizer(str(make_tokenizer_folder(tmp_path / "none", chat_template=None)))
    with pytest.raises(ApiError, match="no chat template"):
        none.chat({"messages": MESSAGES})


@pytest.mark.parametrize("template_in", ["config", "jinja", "json"])
def test_the_template_is_found_wherever_the_folder_keeps_it(
    tmp_path: Path, template_in: str
) -> None:
    """The three places routing.prompt.chat_template reads; the simulator stands in for the
    vLLM worker that renders the same template, so it must find it in each."""
    folder = make_tokenizer_folder(tmp_path / template_in, template_in=template_in)
    expected = truth(folder).encode(rendered_chat(MESSAGES), add_special_tokens=False).ids
    assert HfTokenizer(str(folder)).chat({"messages": MESSAGES}) == expected


def test_chat_template_jinja_comes_before_the_configs_and_named_templates(tmp_path: Path) -> None:
    folder = make_tokenizer_folder(tmp_path / "tok")
    (folder / "chat_template.jinja").write_text("JINJA{{ messages[0]['content'] }}")
    template = HfTokenizer(str(folder)).template
    assert template is not None and template.render(messages=MESSAGES) == "JINJA be brief "
    named = make_tokenizer_folder(tmp_path / "named", chat_template=None)
    config = json.loads((named / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tools", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    assert HfTokenizer(str(named)).template is not None
    assert HfTokenizer(str(named)).template.render(messages=[]) == "D"  # type: ignore[union-attr]
