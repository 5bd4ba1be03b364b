"""A tokenizer folder's chat template: where it is found, and compiled as transformers does.

Hugging Face folders keep the template in one of three places, read here in this order:

1. ``chat_template.jinja`` beside tokenizer.json: what transformers writes since 4.47, and
   what its tokenizer loader prefers ("independent chat template file(s) ... take priority
   over template entries in the tokenizer config", ``PreTrainedTokenizerBase.
   _from_pretrained``). Current folders on the Hub have only this.
2. ``chat_template.json``, ``{"chat_template": "..."}``: the processors' legacy file
   (transformers' LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE). transformers' tokenizer ignores it,
   but vLLM asks a multimodal model's processor for its template before the tokenizer, and
   the processor reads this file. (A processor that finds both files takes this one; a
   folder with both is rare, and the tokenizer's order is kept here.)
3. ``tokenizer_config.json``'s ``chat_template``: a string, or a list of named templates
   of which the one named "default" is rendered. The old place.

A chat_template.json that cannot be read (bad JSON, no string inside) is skipped and the
config is tried: vLLM, too, goes on to the tokenizer when the processor fails to load.
Named extra templates (``additional_chat_templates/``) are not read: vLLM renders the
default one unless a request names another, and such a request goes to the worker.

No module of the simulator may import this one (import-linter: the simulator stands
alone), so simulator.hf_tokenizer keeps its own reader.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2 import Template

JINJA_FILE = "chat_template.jinja"
JSON_FILE = "chat_template.json"
CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True, slots=True)
class FoundTemplate:
    source: str  # the template's text
    origin: str  # the file it came from (JINJA_FILE, JSON_FILE or CONFIG_FILE)


def find_chat_template(folder: Path, config: Mapping[str, Any]) -> FoundTemplate | None:
    """The folder's chat template, or None; `config` is its tokenizer_config.json, read."""
    jinja = folder / JINJA_FILE
    if jinja.is_file():
        return FoundTemplate(jinja.read_text(encoding="utf-8"), JINJA_FILE)
    legacy = _from_json(folder / JSON_FILE)
    if legacy is not None:
        return FoundTemplate(legacy, JSON_FILE)
    source = config_template(config.get("chat_template"))
    return FoundTemplate(source, CONFIG_FILE) if source is not None else None


def config_template(value: Any) -> str | None:
    """A config's chat_template: a string, or a list of named templates of which
    transformers renders the one named "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


@cache
def render_errors() -> tuple[type[Exception], ...]:
    """What rendering a chat template raises when it cannot: jinja2's TemplateError,
    TypeError, ValueError. A function, for ``except render_errors():`` (evaluated only when
    an exception is being matched): jinja2 is imported only by a router that compiles a
    template, that is, one with a tokenizer folder."""
    from jinja2 import TemplateError

    return (TemplateError, TypeError, ValueError)


def compile_chat_template(source: str) -> Template:
    """The template as transformers compiles it (its _compile_jinja_template)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)  # fmt: skip

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])  # fmt: skip
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _from_json(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return None
    return config_template(data.get("chat_template")) if isinstance(data, dict) else None


__all__ = ["FoundTemplate", "compile_chat_template", "config_template", "find_chat_template"]
