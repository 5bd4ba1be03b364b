"""A real Hugging Face tokenizer folder for the simulator (``--tokenizer FOLDER``), used as vLLM
uses it, so a router's local tokenizer can be checked against an engine that agrees with it.

The folder holds ``tokenizer.json`` (loaded with the ``tokenizers`` library) and
``tokenizer_config.json`` (its ``chat_template`` and special tokens). Like vLLM: a chat
request's messages are rendered with the template (jinja2's immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and ``tojson``, as transformers
compiles it; ``add_generation_prompt`` true unless the request says otherwise) and encoded
without adding special tokens (the template has them) unless ``add_special_tokens`` is true;
a plain prompt is encoded with them unless ``add_special_tokens`` is false. Nothing is
downloaded. A template that raises is vLLM's 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from simulator.wire import ApiError

_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


class HfTokenizer:
    def __init__(self, folder: str) -> None:
        path = Path(folder)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        self.specials = {k: _text(config[k]) for k in _SPECIALS if k in config}
        source = _template_source(path, config)
        self.template = _compile(source) if source is not None else None

    def chat(self, body: Mapping[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "`messages` must be a non-empty list.", "messages")
        if self.template is None:
            raise ApiError(400, "The tokenizer has no chat template.", "messages")
        try:
            text = self.template.render(
                **self.specials,
                messages=messages,
                add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            )
        except (TemplateError, TypeError) as exc:
            raise ApiError(400, f"The chat template failed: {exc}", "messages") from exc
        return self.encode(text, special=body.get("add_special_tokens") is True)

    def prompt(self, prompt: str, body: Mapping[str, Any]) -> list[int]:
        return self.encode(prompt, special=body.get("add_special_tokens", True) is not False)

    def encode(self, text: str, *, special: bool) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=special).ids
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids)
        return text


def _template_source(path: Path, config: Mapping[str, Any]) -> str | None:
    """The chat template where transformers finds it: chat_template.jinja first (what
    current folders have), then chat_template.json (the processors' legacy file, which vLLM
    reads through the processor; skipped when unreadable), then the config's field (a
    string, or named templates of which "default"). routing.prompt.chat_template reads the
    same, for the router; the simulator may not import it."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    legacy = path / "chat_template.json"
    if legacy.is_file():
        try:
            found = json.loads(legacy.read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError):
            found = None
        if isinstance(found, str):
            return found
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    return source if isinstance(source, str) else None


def _text(value: Any) -> Any:
    return value.get("content", "") if isinstance(value, dict) else value


def _compile(source: str) -> Template:
    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
