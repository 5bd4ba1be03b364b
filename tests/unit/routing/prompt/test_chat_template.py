"""Where a tokenizer folder's chat template is found (routing.prompt.chat_template), and what the
router's local tokenizer and its /health status make of each layout. Unit tests: the
folders are trained here (harness.tokenizer_folder); nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.tokenizer_folder import CHAT_TEMPLATE, make_tokenizer_folder, rendered_chat
from routing.fleet.snapshot import ServedModelInfo, build_snapshot
from routing.prompt.chat_template import find_chat_template
from routing.prompt.tokenize import NO_TEMPLATE, LocalTokenizer, RequestTokens

MESSAGES = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "tell me about the lazy dog"},
]
OTHER = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"  # a template that differs


def config_of(folder: Path) -> dict[str, object]:
    config: dict[str, object] = json.loads((folder / "tokenizer_config.json").read_text())
    return config


def expected_ids(local: LocalTokenizer) -> list[int]:
    return local.tokenizer.encode(rendered_chat(MESSAGES), add_special_tokens=False).ids


@pytest.mark.parametrize(
    ("template_in", "origin"),
    [
        ("config", "tokenizer_config.json"),
        ("jinja", "chat_template.jinja"),
        ("json", "chat_template.json"),
    ],
)
def test_each_layout_gives_the_template_and_the_same_chat_ids(
    tmp_path: Path, template_in: str, origin: str
) -> None:
    folder = make_tokenizer_folder(tmp_path / template_in, template_in=template_in)
    found = find_chat_template(folder, config_of(folder))
    assert found is not None and (found.source, found.origin) == (CHAT_TEMPLATE, origin)
    local = LocalTokenizer(str(folder))
    assert local.template_origin == origin
    assert local.chat({"messages": MESSAGES}) == expected_ids(local)


def test_the_jinja_file_wins_over_the_configs_field_and_the_json_file(tmp_path: Path) -> None:
    """transformers' tokenizer: a chat_template.jinja takes priority over the config's."""
    folder = make_tokenizer_folder(tmp_path / "both", template_in="jinja")
    config = config_of(folder) | {"chat_template": OTHER}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": OTHER}))
    found = find_chat_template(folder, config)
    assert found is not None and (found.source, found.origin) == (
        CHAT_TEMPLATE,
        "chat_template.jinja",
    )
    local = LocalTokenizer(str(folder))
    assert local.chat({"messages": MESSAGES}) == expected_ids(local)


def test_the_json_file_wins_over_the_config_and_a_broken_one_is_skipped(tmp_path: Path) -> None:
    folder = make_tokenizer_folder(tmp_path / "json", template_in="json")
    config = config_of(folder) | {"chat_template": OTHER}
    found = find_chat_template(folder, config)
    assert found is not None and found.origin == "chat_template.json"
    for broken in ("{not json", '{"chat_template": 3}', "[]"):
        (folder / "chat_template.json").write_text(broken)
        found = find_chat_template(folder, config)
        assert found is not None and (found.source, found.origin) == (
            OTHER,
            "tokenizer_config.json",
        )


def test_a_configs_named_templates_give_the_default_one(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": OTHER}, {"name": "default", "template": "x"}]
    found = find_chat_template(tmp_path, {"chat_template": named})
    assert found is not None and found.source == "x"
    assert find_chat_template(tmp_path, {"chat_template": [{"name": "tool_use"}]}) is None


def test_health_says_which_folders_have_no_chat_template(tmp_path: Path) -> None:
    """A prompts-only folder is loaded but does not serve chat: /health must not read as if
    it did (its chat requests still take the worker's /tokenize hop)."""
    chat = make_tokenizer_folder(tmp_path / "chat", template_in="jinja")
    plain = make_tokenizer_folder(tmp_path / "plain", chat_template=None)
    tokens = RequestTokens()
    models = [
        ServedModelInfo("a", policy="kv_aware", tokenizer=str(chat)),
        ServedModelInfo("b", policy="kv_aware", tokenizer=str(plain)),
    ]
    try:
        tokens.install(build_snapshot(workers=(), served_models=models, generation=1))
        assert tokens.status() == {str(chat): "loaded", str(plain): NO_TEMPLATE}
    finally:
        tokens.close()
