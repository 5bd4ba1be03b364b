"""The prefill leg's body, the decode leg's body, and the transfer parameters between them.

The prefill body is the client's request with vLLM's overrides (its disaggregated proxies
apply the same): one token, not streamed, no stream options or minimum lengths, and
`kv_transfer_params` asking for a remote decode. The decode body is the client's own
bytes with only the prefill answer's `kv_transfer_params` spliced in, so every field vLLM
understands and the router does not still reaches the decode worker as sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from routing.policies.base import Choice, RequestInfo

FIELD = "kv_transfer_params"
# What a prefill leg never carries: it answers with one token, whole.
_PREFILL_DROP = frozenset({"stream_options", "min_tokens", "min_completion_tokens", FIELD})
ASK_REMOTE_DECODE: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Tokens per character of prompt text, when no token ids were made: English and code
# average about four characters a token; the bypass needs an estimate, not a count.
_CHARS_PER_TOKEN = 4


def prefill_body(payload: Mapping[str, Any], model: str) -> bytes:
    """The prefill leg's body: the client's fields with vLLM's prefill overrides, for the
    served `model` (an alias or a fallback is named by the model it resolved to)."""
    body = {k: v for k, v in payload.items() if k not in _PREFILL_DROP}
    body["model"] = model
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body[FIELD] = dict(ASK_REMOTE_DECODE)
    return orjson.dumps(body)


def decode_body(body: bytes, params: Mapping[str, Any]) -> bytes:
    """The client's bytes with `kv_transfer_params` spliced in as the object's first field
    (the client's own has none: such a request is never disaggregated)."""
    start = body.index(b"{") + 1
    field = b'"' + FIELD.encode() + b'":' + orjson.dumps(params)
    rest = body[start:]
    separator = b"" if rest.lstrip().startswith(b"}") else b","
    return body[:start] + field + separator + rest


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The prefill answer's `kv_transfer_params`, or None when it has none."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = parsed.get(FIELD) if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) else None


def uncached_tokens(request: RequestInfo, choice: Choice | None = None) -> int:
    """An estimate of the prompt tokens the prefill leg would compute: the prompt's tokens
    (counted when they were made for kv_aware, else from the text's length) less what a
    cache-aware policy predicts the chosen prefill worker holds."""
    if request.tokens is not None:
        total = len(request.tokens)
    else:
        text = request.text if request.text is not None else _prompt_text(request.body)
        total = len(text) // _CHARS_PER_TOKEN
    prediction = choice.prediction if choice is not None else None
    if prediction is None:
        return total
    cached = prediction.tokens if prediction.tokens is not None else prediction.share * total
    return max(0, total - int(cached))


def _prompt_text(body: Mapping[str, Any]) -> str:
    """Only for the estimate: the prompt or the messages' text, joined."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "\n".join(parts)
