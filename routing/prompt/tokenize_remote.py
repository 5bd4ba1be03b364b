"""A request's token ids from the worker itself, in one hop, when no local tokenizer can make them.

Two ways, in order, each on the router's one long-lived session with its own short timeout
(TOKENIZE_TIMEOUT):

* **vLLM's render routes** (0.32, with ``--enable-scale-out``): ``/v1/chat/completions/render``,
  ``/v1/completions/render``, ``/v1/messages/render`` and ``/v1/responses/render`` template and
  tokenize a request exactly as its own route would, without running the model, and answer
  the engine's input (``token_ids``). They take the client's body as it is, so they cover
  what ``/tokenize`` cannot: Anthropic's ``/v1/messages`` (coding agents), ``/v1/responses``,
  and chat with every key the chat route reads. A completions render answers a list, one
  input per prompt; only a single prompt gives tokens.
* **``POST /tokenize``** (every vLLM): chat messages (with the keys /tokenize takes as the
  chat route does) or a completions prompt given as text; nothing else.

A worker that answers a render route with 403 (scale-out disabled), 404 or 405 (an older
vLLM) is asked by ``/tokenize`` from then on, and its render routes are tried again after
RENDER_RETRY_S, so a server restarted with the flag is found. Any other failure gives None:
routing then goes on without exact tokens (kv_aware's counted fallback), never fails over it.
:meth:`RemoteTokens.via` says which way each model went last, for ``/health``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from routing.fleet.snapshot import WorkerView

log = logging.getLogger(__name__)

TOKENIZE_TIMEOUT = aiohttp.ClientTimeout(total=2.0, sock_connect=1.0)
RENDER_RETRY_S = 300.0
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RENDER_PATHS = {
    CHAT_PATH: "/v1/chat/completions/render",
    COMPLETIONS_PATH: "/v1/completions/render",
    "/v1/messages": "/v1/messages/render",
    "/v1/responses": "/v1/responses/render",
}
# Chat keys the worker's /tokenize takes as the chat endpoint does.
_CHAT_KEYS = ("messages", "tools", "add_generation_prompt", "continue_final_message",
              "add_special_tokens", "chat_template", "chat_template_kwargs")  # fmt: skip
# Render answers meaning "not here": scale-out disabled (403), an older vLLM (404, 405).
_NO_RENDER = frozenset({403, 404, 405})


class RemoteTokens:
    """The hop to a worker, render first; remembers the workers that cannot render."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._no_render: dict[str, float] = {}  # worker URL -> when it last refused
        self.via: dict[str, str] = {}  # model -> "render" or "tokenize", as it went last

    async def of(
        self,
        session: aiohttp.ClientSession,
        worker: WorkerView,
        model: str,
        path: str,
        body: Mapping[str, Any],
    ) -> list[int] | None:
        """The request's token ids as `worker` will see them, or None."""
        if path in RENDER_PATHS and self._may_render(worker.url):
            ids, status = await _rendered(session, worker, model, path, body)
            if status not in _NO_RENDER:
                if ids is not None:
                    self.via[model] = "render"
                return ids
            self._no_render[worker.url] = self._clock()
        ids = await _tokenized(session, worker, model, path, body)
        if ids is not None:
            self.via[model] = "tokenize"
        return ids

    def _may_render(self, url: str) -> bool:
        refused = self._no_render.get(url)
        if refused is None:
            return True
        if self._clock() - refused >= RENDER_RETRY_S:
            del self._no_render[url]
            return True
        return False


async def _rendered(
    session: aiohttp.ClientSession,
    worker: WorkerView,
    model: str,
    path: str,
    body: Mapping[str, Any],
) -> tuple[list[int] | None, int]:
    """(token ids, the answer's status; 0 when none came) of the route's render."""
    ask = {**body, "model": model}
    answer = await _post(session, worker, RENDER_PATHS[path], ask)
    if answer is None:
        return None, 0
    status, data = answer
    if status != 200:
        return None, status
    if path == COMPLETIONS_PATH:  # one engine input per prompt
        data = data[0] if isinstance(data, list) and len(data) == 1 else None
    tokens: Any = data.get("token_ids") if isinstance(data, dict) else None
    return (list(tokens) if token_ids(tokens) else None), status


async def _tokenized(
    session: aiohttp.ClientSession,
    worker: WorkerView,
    model: str,
    path: str,
    body: Mapping[str, Any],
) -> list[int] | None:
    """The worker's /tokenize of chat messages or a text prompt."""
    if path == CHAT_PATH:
        ask: dict[str, Any] = {k: body[k] for k in _CHAT_KEYS if k in body}
    elif path == COMPLETIONS_PATH and isinstance(body.get("prompt"), str):
        ask = {"prompt": body["prompt"], "add_special_tokens": body.get("add_special_tokens", True)}
    else:
        return None
    ask["model"] = model
    answer = await _post(session, worker, "/tokenize", ask)
    if answer is None or answer[0] != 200 or not isinstance(answer[1], dict):
        return None
    tokens: Any = answer[1].get("tokens")
    return list(tokens) if token_ids(tokens) else None


async def _post(
    session: aiohttp.ClientSession, worker: WorkerView, path: str, ask: Mapping[str, Any]
) -> tuple[int, Any] | None:
    """(status, the JSON answer or None), or None when no answer came."""
    headers = {"Content-Type": "application/json"}
    if worker.upstream_authorization is not None:
        headers["Authorization"] = worker.upstream_authorization
    try:
        async with session.post(
            worker.url + path, data=orjson.dumps(ask), headers=headers,
            timeout=TOKENIZE_TIMEOUT, allow_redirects=False,
        ) as answer:  # fmt: skip
            raw = await answer.read()
            try:
                return answer.status, orjson.loads(raw)
            except orjson.JSONDecodeError:
                return answer.status, None
    except (TimeoutError, aiohttp.ClientError) as exc:
        log.debug("%s on %s failed: %r", path, worker.name, exc)
        return None


def token_ids(value: Any) -> bool:
    """A non-empty list of ints (not bools)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
