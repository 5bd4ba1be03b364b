"""A request's prompt as token ids, the way the vLLM worker will see them (for kv_aware).

vLLM matches its prefix cache on token ids, block by block, so a router that wants to know
exactly what a worker holds must route on the same ids. Two ways to get them, in order:

* **A local tokenizer** (preferred: no extra hop). A served model's ``tokenizer`` is a local
  folder holding a Hugging Face ``tokenizer.json`` and ``tokenizer_config.json``, its chat
  template in ``chat_template.jinja`` or the config (routing.prompt.chat_template finds it). The
  tokenizer is loaded with the `tokenizers` library, off the request path (on a thread, when
  a snapshot names a folder not loaded yet), and cached per folder. Chat requests are
  rendered with the folder's chat template the way transformers' ``apply_chat_template``
  and vLLM render it: jinja2's immutable sandbox, ``trim_blocks`` and ``lstrip_blocks``,
  the ``loopcontrols`` extension, ``raise_exception``, ``strftime_now``, a ``tojson`` that
  keeps non-ASCII, ``add_generation_prompt`` (vLLM's default: true), the special tokens of
  the config (``bos_token``, ``eos_token``, ...) and the request's ``chat_template_kwargs``;
  the text is then encoded without special tokens (vLLM's chat default: the template adds
  them), from cached pieces where the tokenizer allows it (routing.prompt.tokenize_segments: the
  text between special tokens encoded apart, so a conversation's earlier turns are not
  encoded again; checked against the whole on live traffic). A completions prompt is
  encoded with special tokens (vLLM's default there), and a
  prompt of token ids is taken as it is. A text past INLINE_CHARS is encoded on a thread,
  with ``encode_batch``, which lets go of the GIL (``encode`` holds it: a 4k-word prompt
  would stall the event loop for milliseconds). Nothing is ever downloaded. A folder is read once
  per path: to pick up a changed tokenizer.json, set the model's folder to a new path (or
  clear it and set it again).
* **The worker's own ``POST /tokenize``** otherwise: one extra round trip on the router's one
  long-lived session, with its own short timeout (TOKENIZE_TIMEOUT), to the least loaded
  worker of the model. Exact, but it costs a hop: ``controlpanel_router_tokenize_seconds``
  measures both ways.

What neither can do exactly gives None and the policy falls back to its approximate index,
counted on /metrics: a batch of prompts, multimodal content, a request's own
``chat_template``, ``continue_final_message``, other routes (/v1/responses, /v1/messages),
a failed hop. A template that cannot render locally (raise_exception, an unknown tag) goes
to the worker, which answers what vLLM would.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from routing.fleet.snapshot import ModelRoute, Snapshot, WorkerView
from routing.histograms import PlainHistogram
from routing.policies import policy_class
from routing.policies.load import least_loaded
from routing.prompt.chat_template import compile_chat_template, find_chat_template, render_errors
from routing.prompt.tokenize_remote import RENDER_PATHS, RemoteTokens, token_ids
from routing.prompt.tokenize_segments import PieceCache, Plan, tokenizer_json

if TYPE_CHECKING:
    from jinja2 import Template
    from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)

# Past this many characters encoding runs on a thread: a long prompt takes milliseconds of
# CPU, and the event loop serves every other request meanwhile (encode_batch drops the GIL).
INLINE_CHARS = 8192
SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
NO_TEMPLATE = "loaded, no chat template (chat is tokenized by the worker)"
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")  # fmt: skip


class TokenizerFolderError(ValueError):
    """A tokenizer folder that cannot be used, with the reason."""


def check_folder(folder: str) -> Path:
    """The folder as a Path, or TokenizerFolderError naming what is missing (also what the
    control plane checks when an operator sets it)."""
    path = Path(folder)
    if not path.is_absolute():
        raise TokenizerFolderError(f"the tokenizer folder must be an absolute path: {folder!r}")
    if not path.is_dir():
        raise TokenizerFolderError(f"no such folder: {folder}")
    if not (path / "tokenizer.json").is_file():
        raise TokenizerFolderError(f"{folder} has no tokenizer.json")
    return path


class LocalTokenizer:
    """One tokenizer folder: the tokenizer, its chat template (compiled once) and specials."""

    def __init__(self, folder: str) -> None:
        # Imported here, where a folder is loaded: tokenizers costs a process ~6 MiB, and
        # a router with no tokenizer folder never needs it.
        from tokenizers import Tokenizer

        path = check_folder(folder)
        raw = (path / "tokenizer.json").read_text(encoding="utf-8")
        self.tokenizer = Tokenizer.from_str(raw)
        self.pieces = PieceCache(self.tokenizer, tokenizer_json(raw))
        config = _read_config(path / "tokenizer_config.json")
        self.specials = {k: _token_text(config[k]) for k in _SPECIAL_TOKENS if k in config}
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            self.specials["additional_special_tokens"] = [_token_text(t) for t in extra]
        found = find_chat_template(path, config)
        self.template: Template | None = None
        self.template_origin: str | None = None  # the file it came from, for /health
        if found is not None and found.source:
            self.template = compile_chat_template(found.source)
            self.template_origin = found.origin

    def chat(self, body: Mapping[str, Any]) -> list[int] | None:
        """A chat request's ids, or None when they cannot be made exactly here."""
        text = self.render(body)
        return None if text is None else self.encode(text, special=chat_specials(body))

    def render(self, body: Mapping[str, Any]) -> str | None:
        """A chat request's prompt text, as the template makes it (None: not here)."""
        if self.template is None or "chat_template" in body or body.get("continue_final_message"):
            return None
        messages = _plain_messages(body.get("messages"))
        if messages is None:
            return None
        kwargs = body.get("chat_template_kwargs")
        context: dict[str, Any] = {**self.specials, **(kwargs if isinstance(kwargs, dict) else {})}
        context.update(
            messages=messages,
            tools=body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True) is not False,
        )
        try:
            text: str = self.template.render(**context)
        except render_errors() as exc:
            log.debug("chat template did not render here (%s); the worker will", exc)
            return None
        return text

    def prompt(self, prompt: str, body: Mapping[str, Any]) -> list[int]:
        return self.encode(prompt, special=prompt_specials(body))

    def encode(self, text: str, *, special: bool) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=special).ids
        return ids

    def encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        """Pieces of a chat prompt between its special tokens, each on its own (the caller
        cut them; routing.prompt.tokenize_segments). encode_batch lets go of the GIL."""
        if not pieces:
            return []
        return [e.ids for e in self.tokenizer.encode_batch(pieces, add_special_tokens=False)]

    def encode_unlocked(self, text: str, special: bool) -> list[int]:
        """encode() for another thread: encode_batch lets go of the GIL while it works
        (encode does not), so the event loop keeps serving meanwhile."""
        ids: list[int] = self.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids
        return ids


def chat_specials(body: Mapping[str, Any]) -> bool:
    """vLLM's chat default: no special tokens added (the template has them)."""
    return body.get("add_special_tokens") is True


def prompt_specials(body: Mapping[str, Any]) -> bool:
    """vLLM's completions default: special tokens added."""
    return body.get("add_special_tokens", True) is not False


class RequestTokens:
    """The router's tokenizers: loaded per folder as snapshots name them, used per request."""

    def __init__(self) -> None:
        self._by_folder: dict[str, LocalTokenizer] = {}
        self._loading: set[str] = set()
        self.load_errors: dict[str, str] = {}  # folder -> why it could not be loaded
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # (model, source) -> seconds; source: local, worker. And outcomes by (model, source).
        self.seconds: dict[tuple[str, str], PlainHistogram] = {}
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.remote = RemoteTokens()

    # -- off the request path ---------------------------------------------------------------

    def install(self, snapshot: Snapshot) -> None:
        """Start loading every folder the snapshot names that is not loaded yet; folders no
        model names any more are dropped. Until a folder is loaded, the worker tokenizes."""
        wanted = {route.tokenizer for route in snapshot.routes.values() if route.tokenizer}
        for gone in set(self._by_folder) - wanted:
            del self._by_folder[gone]
        for folder in wanted - set(self._by_folder) - self._loading:
            self._loading.add(folder)
            self.load_errors.pop(folder, None)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a test or a command without a loop: load here and now
                self._loaded(folder, _load(folder))
                continue
            future = loop.run_in_executor(self._encoder, _load, folder)
            future.add_done_callback(partial(self._done, folder))

    def _done(self, folder: str, future: asyncio.Future[LocalTokenizer | str]) -> None:
        self._loaded(folder, future.result())

    def _loaded(self, folder: str, result: LocalTokenizer | str) -> None:
        self._loading.discard(folder)
        if isinstance(result, str):
            self.load_errors[folder] = result
            log.error("tokenizer folder %s cannot be used: %s", folder, result)
        else:
            self._by_folder[folder] = result

    def status(self) -> dict[str, str]:
        """Each folder: "loaded", "loading", or why it could not be loaded. A folder without
        a chat template says so: it tokenizes prompts only, and chat takes the worker's hop."""
        state = {
            folder: "loaded" if local.template is not None else NO_TEMPLATE
            for folder, local in self._by_folder.items()
        }
        state.update(dict.fromkeys(self._loading, "loading"))
        state.update(self.load_errors)
        return state

    def sources(self, snapshot: Snapshot) -> dict[str, str]:
        """How each model whose policy wants tokens gets them (/health): "local" (a loaded
        folder), else the worker's hop as it went last ("render" or "tokenize"), else
        "worker" (no request yet)."""
        wanted = (r for r in snapshot.routes.values() if _wants_tokens(r.policy))
        return {
            route.name: "local"
            if self.local(route) is not None
            else self.remote.via.get(route.name, "worker")
            for route in wanted
        }

    def loaded(self) -> dict[str, LocalTokenizer]:
        return dict(self._by_folder)

    def local(self, route: ModelRoute) -> LocalTokenizer | None:
        return self._by_folder.get(route.tokenizer) if route.tokenizer else None

    # -- the request path -------------------------------------------------------------------

    async def of(
        self,
        session: aiohttp.ClientSession,
        path: str,
        route: ModelRoute,
        body: Mapping[str, Any],
        workers: Sequence[WorkerView],
        loads: Mapping[int, int],
    ) -> list[int] | None:
        """The request's token ids (local tokenizer first, then the least loaded worker's
        /tokenize), or None; every outcome is counted under the model."""
        started = perf_counter()
        ids = await self._local(route, path, body)
        source = "local"
        if ids is None and path in RENDER_PATHS:
            worker = least_loaded(workers, loads)
            if worker is not None:
                source = "worker"
                ids = await self.remote.of(session, worker, route.name, path, body)
        outcome = source if ids is not None else "none"
        self.outcomes[route.name, outcome] += 1
        if ids is not None:
            self._timed(route.name, source, perf_counter() - started)
        return ids

    async def _local(
        self, route: ModelRoute, path: str, body: Mapping[str, Any]
    ) -> list[int] | None:
        prompt = body.get("prompt")
        if path == COMPLETIONS_PATH and token_ids(prompt):
            return prompt  # type: ignore[no-any-return]  # checked: a list of ints
        local = self.local(route)
        if local is None:
            return None
        if path == CHAT_PATH:
            text, special = local.render(body), chat_specials(body)
        elif path == COMPLETIONS_PATH and isinstance(prompt, str):
            text, special = prompt, prompt_specials(body)
        else:
            return None
        if text is None:
            return None
        plan = local.pieces.plan(text) if path == CHAT_PATH and not special else None
        if plan is not None:
            return await self._from_pieces(local, plan, text)
        if len(text) <= INLINE_CHARS:
            return local.encode(text, special=special)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._encoder, local.encode_unlocked, text, special)

    async def _from_pieces(self, local: LocalTokenizer, plan: Plan, text: str) -> list[int]:
        """A chat prompt from its cached pieces, encoding only the new ones (on the thread
        when they are long); now and then checked against the whole, on the thread."""
        missing, encode = plan.missing, local.encode_pieces
        loop = asyncio.get_running_loop()
        if sum(map(len, missing)) <= INLINE_CHARS:
            encoded = encode(missing)
        else:
            encoded = await loop.run_in_executor(self._encoder, encode, missing)
        ids = local.pieces.join(plan, encoded)
        if local.pieces.due_check():
            loop.run_in_executor(self._encoder, local.pieces.check, local.tokenizer, text, ids)
        return ids

    def local_only(self, route: ModelRoute, body: Mapping[str, Any]) -> list[int] | None:
        """The ids a local tokenizer makes of a body, on this thread (the admin dry run)."""
        local = self.local(route)
        prompt = body.get("prompt")
        if token_ids(prompt):
            return prompt  # type: ignore[no-any-return]  # checked: a list of ints
        if local is None:
            return None
        return local.prompt(prompt, body) if isinstance(prompt, str) else local.chat(body)

    def _timed(self, model: str, source: str, seconds: float) -> None:
        histogram = self.seconds.get((model, source))
        if histogram is None:
            histogram = self.seconds[model, source] = PlainHistogram(SECONDS_BUCKETS)
        histogram.observe(seconds)

    def close(self) -> None:
        self._encoder.shutdown(wait=False)


class TokenizeCollector(Collector):
    """Tokenization on /metrics: how long it took by source, and how often each way served."""

    def __init__(self, tokens: RequestTokens) -> None:
        self.tokens = tokens

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        seconds = HistogramMetricFamily(
            "controlpanel_router_tokenize_seconds",
            "Time to get a request's token ids for kv_aware, by model and source (local: the "
            "model's tokenizer folder; worker: a POST /tokenize hop).",
            labels=["model", "source"],
        )
        for (model, source), histogram in self.tokens.seconds.items():
            seconds.add_metric([model, source], histogram.cumulative(), histogram.total)
        yield seconds
        outcomes = CounterMetricFamily(
            "controlpanel_router_tokenize_requests",
            "Requests tokenized for kv_aware, by model and outcome (local, worker, or none: "
            "no exact ids, so the policy fell back to its approximate index).",
            labels=["model", "outcome"],
        )
        for (model, outcome), count in self.tokens.outcomes.items():
            outcomes.add_metric([model, outcome], count)
        yield outcomes
        errors = CounterMetricFamily(
            "controlpanel_router_tokenizer_load_errors",
            "Tokenizer folders named by a served model that could not be loaded (1 each).",
            labels=["folder"],
        )
        for folder in self.tokens.load_errors:
            errors.add_metric([folder], 1)
        yield errors
        yield self._pieces()

    def _pieces(self) -> Metric:
        pieces = CounterMetricFamily(
            "controlpanel_router_tokenizer_pieces",
            "Chat prompts' pieces between special tokens (routing.prompt.tokenize_segments), by "
            "tokenizer folder and outcome: hit (cached), miss (encoded), check_match and "
            "check_mismatch (a prompt encoded whole too, off the path, and compared; one "
            "mismatch turns the folder's cache off).",
            labels=["folder", "outcome"],
        )
        for folder, local in self.tokens.loaded().items():
            for outcome in ("hit", "miss", "check_match", "check_mismatch"):
                pieces.add_metric([folder, outcome], local.pieces.counts[outcome])
        return pieces


# --- helpers -------------------------------------------------------------------------------


def _load(folder: str) -> LocalTokenizer | str:
    """A loaded folder, or why not (on the loading thread: never raises)."""
    try:
        return LocalTokenizer(folder)
    except Exception as exc:  # noqa: BLE001 - any broken folder must leave routing working
        return f"{type(exc).__name__}: {exc}"


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    return config if isinstance(config, dict) else {}


def _token_text(value: Any) -> Any:
    """A special token as the template sees it: AddedToken dicts give their content."""
    return value.get("content", "") if isinstance(value, dict) else value


def _plain_messages(messages: Any) -> list[dict[str, Any]] | None:
    """Messages as vLLM hands them to a string-content template: text parts joined by a
    newline, tool-call arguments parsed from their JSON; None for anything else (images,
    audio...), which only the worker can tokenize exactly."""
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                return None
            message = {**message, "content": "\n".join(str(p.get("text", "")) for p in content)}
        if isinstance(message.get("tool_calls"), list):
            message = {**message, "tool_calls": [_parsed_call(c) for c in message["tool_calls"]]}
        out.append(message)
    return out


def _parsed_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _wants_tokens(policy: str) -> bool:
    try:
        return policy_class(policy).needs_request_tokens
    except ValueError:  # an unknown name routes by the default policy, which needs none
        return False


__all__ = ["LocalTokenizer", "RequestTokens", "TokenizeCollector", "check_folder"]
