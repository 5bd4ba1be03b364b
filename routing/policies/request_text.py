"""The prompt of a request as one string, for policies that route by its content.

Only a policy with `needs_request_text` (prefix_aware) pays for this, once per request, so
it is a handful of string joins over the parsed body: no JSON re-encoding, no tokenizer.
The text only has to be *stable* (the same prompt always gives the same text) and
*prefix-preserving* (a prompt that extends another, such as the next turn of a chat, gives
a text that extends the other's text), because the policy compares texts by their leading
characters to guess which worker holds a prompt's prefix in its KV cache.

* Chat (`messages`; also Anthropic-style `/v1/messages`, whose `system` comes first): each
  message's role, then its content, in order. Content is a string or a list of parts; text
  parts give their text, an image (or audio, video, file) part a short marker naming its
  URL, so two requests that differ only by their image differ here too. A long URL (a
  base64 `data:` URL can be megabytes) is shortened to its start, its length and its
  in-process hash. Tool calls of assistant messages add their function name and arguments.
* Completions (`prompt`): a string as is; a list of strings joined; token ids as decimal
  numbers separated by spaces (a list of lists of ids likewise, one list after the other).
* Anything else (`/v1/responses`' `input`, embeddings): `input` read the same way, as a
  string, a list of strings or ids, or a list of message-like items, after the Responses
  API's `instructions` (as a system message) when present.

Separators are control characters that do not occur in ordinary text (U+001E between
messages and parts, U+001F between a role and its content), so a message boundary never
looks like text. Malformed shapes are skipped rather than rejected: the worker validates
the body; this only has to be cheap and never raise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["request_text"]

_MSG = "\x1e"  # between messages (and between the parts of one content list)
_ROLE = "\x1f"  # between a message's role and its content
_URL_KEEP = 96  # URLs up to this many characters are kept whole in a marker
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
_MEDIA_KEYS = ("image_url", "video_url", "audio_url", "input_audio", "file", "image")


def request_text(body: Mapping[str, Any]) -> str:
    """The request's prompt as one string ("" when it has none)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        system = body.get("system")  # Anthropic /v1/messages keeps it out of the list
        head = "system" + _ROLE + _content_text(system) + _MSG if system else ""
        return head + _messages_text(messages)
    prompt = body.get("prompt")
    if prompt is not None:
        return _prompt_text(prompt)
    value = body.get("input")
    instructions = body.get("instructions")  # /v1/responses' system prompt
    head = "system" + _ROLE + instructions + _MSG if isinstance(instructions, str) else ""
    if isinstance(value, list) and value and isinstance(value[0], Mapping):
        return head + _messages_text(value)
    return head + _prompt_text(value) if value is not None else head


def _messages_text(messages: list[Any]) -> str:
    out: list[str] = []
    for msg in messages:
        if not isinstance(msg, Mapping):
            continue
        role = msg.get("role")
        content = msg.get("content")
        text = content if isinstance(content, str) else _content_text(content)
        tool_calls = msg.get("tool_calls")
        if tool_calls:
            text += _tool_calls_text(tool_calls)
        out.append((role if isinstance(role, str) else "") + _ROLE + text)
    return _MSG.join(out)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    out: list[str] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, Mapping):
            if part.get("type") in _TEXT_PART_TYPES:
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text)
            else:
                out.append(_media_marker(part))
    return _MSG.join(out)


def _media_marker(part: Mapping[str, Any]) -> str:
    """`<image_url:URL>` for a media part; a long URL shortened, but still distinct."""
    for key in _MEDIA_KEYS:
        value = part.get(key)
        if value is None:
            continue
        if isinstance(value, Mapping):  # {"url": ...}, {"data": ...}, {"file_id": ...}
            value = value.get("url") or value.get("data") or value.get("file_id") or ""
        ref = value if isinstance(value, str) else ""
        if len(ref) > _URL_KEEP:
            # hash() of a str is cached on the object and process-local, like the policy's
            # state; the start keeps a readable hint, the length and hash keep it distinct.
            ref = f"{ref[:32]}..{len(ref)}:{hash(ref) & 0xFFFFFFFFFFFF:012x}"
        return f"<{key}:{ref}>"
    kind = part.get("type")
    return f"<{kind}>" if isinstance(kind, str) else "<part>"


def _tool_calls_text(tool_calls: Any) -> str:
    if not isinstance(tool_calls, list):
        return ""
    out: list[str] = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping):
            out.append(f"{_MSG}{fn.get('name', '')}({fn.get('arguments', '')})")
    return "".join(out)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        return ""
    first = prompt[0]
    if isinstance(first, int):  # token ids
        return " ".join(map(str, prompt))
    out: list[str] = []
    for part in prompt:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, list):
            out.append(" ".join(map(str, part)))
    return _MSG.join(out)
