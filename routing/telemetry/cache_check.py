"""Cache predictions checked against the truth: does cache-aware routing work, or why not?

A cache-aware policy (prefix_aware, kv_aware) leaves a `Prediction` when it routes: how many
of the prompt's tokens it expects the chosen worker's prefix cache to hold. vLLM reports how
many it did hold in the answer's ``usage.prompt_tokens_details.cached_tokens`` (started with
``--enable-prompt-tokens-details``). `CacheCheck.watch` wraps the answer's way to the client
like routing.admission.usage's tap: it keeps the last TAIL_BYTES of a 2xx answer (one append per
chunk, nothing parsed while chunks flow; never a buffer of the stream) and, when the answer
ends (a stream: at its ``data: [DONE]``), reads the last ``usage`` object there. A stream
carries it only when the client asked for ``stream_options.include_usage`` (or the router
did, for a keyed client).

prefix_aware predicts a share of the prompt (its matched bytes over the prompt's bytes);
the check turns it into tokens with the answer's own ``prompt_tokens``, rounded down to a
block, so both policies are judged in tokens. Per (model, policy) /metrics then has:

* ``controlpanel_router_cache_prediction_error_tokens{model,policy}`` (histogram):
  |predicted - reported| cached tokens per checked request;
* ``controlpanel_router_cache_predictions_within_block_total{model,policy}``: checked
  requests whose error is at most one block (the prediction's block size; 16 for
  prefix_aware). Over the histogram's ``_count``, the accuracy;
* ``controlpanel_router_cache_predicted_tokens_total`` and
  ``controlpanel_router_cache_reported_tokens_total{model,policy}``: sums, so a rule can
  tell a policy that over-promises (evictions it cannot see) from one that under-promises;
* ``controlpanel_router_cache_predictions_unchecked_total{model,policy}``: routed with a
  prediction, answered 2xx, but with no ``cached_tokens`` to check it against (a stream
  without usage, counted at once and its chunks left unwrapped; a worker without
  --enable-prompt-tokens-details), so silence shows too.

And kv_aware's fallbacks by reason: ``controlpanel_router_kv_aware_fallbacks_total``.

A request retried on another worker keeps its first attempt's prediction (a retry is rare,
and the policy's next prediction would have to be taken at the retry).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from routing.admission.usage import usage_object
from routing.asgi_types import Message, Send
from routing.histograms import PlainHistogram
from routing.policies.base import Prediction

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from routing.exchange import Exchange
    from routing.policies.base import BasePolicy

TAIL_BYTES = 4096  # a usage object is a few hundred bytes, and vLLM puts little after it
ERROR_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Tally:
    """One (model, policy)'s checked predictions."""

    errors: PlainHistogram = field(default_factory=lambda: PlainHistogram(ERROR_BUCKETS))
    within_block: int = 0
    predicted: int = 0
    reported: int = 0
    unchecked: int = 0


class CacheCheck:
    """Every (model, policy)'s tally; the event loop is the only writer."""

    def __init__(self) -> None:
        self.tallies: dict[tuple[str, str], Tally] = {}

    def watch(self, ex: Exchange) -> Send:
        """ex.send, wrapped to check the policy's prediction when it has one for this
        request and worker; otherwise ex.send itself, at no cost."""
        prediction = ex.prediction
        if prediction is None or prediction.request is not ex.request:
            return ex.send
        if prediction.worker_id != ex.worker.id:
            return ex.send
        tally = self._tally(ex.model, ex.policy.name)
        if _stream_without_usage(ex.request.body):  # nothing to read: spare every chunk
            tally.unchecked += 1
            return ex.send
        tail = _AnswerTail(ex.send, prediction, tally)
        tail.exchange, tail.decision = ex, ex.decision
        return tail.send

    def _tally(self, model: str, policy: str) -> Tally:
        tally = self.tallies.get((model, policy))
        if tally is None:
            tally = self.tallies[model, policy] = Tally()
        return tally


class _AnswerTail:
    """The last TAIL_BYTES of one answer, checked against its prediction at the end."""

    __slots__ = ("_next", "_on", "_prediction", "_size", "_tail", "_tally", "decision", "exchange")

    def __init__(self, send: Send, prediction: Prediction, tally: Tally) -> None:
        self._next, self._prediction, self._tally = send, prediction, tally
        self._tail: deque[bytes] = deque()
        self._size = 0
        self._on = False
        # The request, where the checked prediction is left for the access log, and the
        # policy's decision that made it.
        self.exchange: Exchange | None = None
        self.decision = ""

    async def send(self, message: Message) -> None:
        await self._next(message)
        if message["type"] == "http.response.start":
            self._on = 200 <= message["status"] < 300
        elif self._on:
            chunk = message.get("body", b"")
            if chunk:
                self._tail.append(chunk)
                self._size += len(chunk)
                while self._size - len(self._tail[0]) >= TAIL_BYTES:
                    self._size -= len(self._tail.popleft())
            # A stream is checked at its [DONE]: a client may hang up right after it, and
            # the answer's last message then never comes this way.
            if not message.get("more_body", False) or chunk.endswith(_DONE):
                self._on = False
                self._check(b"".join(self._tail))

    def _check(self, tail: bytes) -> None:
        usage = usage_object(tail)
        reported = _cached_tokens(usage)
        tally = self._tally
        if reported is None or usage is None:
            tally.unchecked += 1
            return
        predicted = predicted_tokens(self._prediction, usage.get("prompt_tokens"))
        error = abs(predicted - reported)
        tally.errors.observe(error)
        tally.within_block += error <= self._prediction.block_size
        tally.predicted += predicted
        tally.reported += reported
        if self.exchange is not None:
            self.exchange.cache = {
                "decision": self.decision, "predicted": predicted, "reported": reported,
                "block_size": self._prediction.block_size,
            }  # fmt: skip


def predicted_tokens(prediction: Prediction, prompt_tokens: Any) -> int:
    """The prediction in tokens: as given, or its share of the answer's prompt tokens, in
    whole blocks (vLLM caches whole blocks only)."""
    if prediction.tokens is not None:
        return prediction.tokens
    if not isinstance(prompt_tokens, int) or prompt_tokens <= 0:
        return 0
    size = prediction.block_size
    return int(prediction.share * prompt_tokens) // size * size


def _stream_without_usage(body: Mapping[str, Any]) -> bool:
    """A stream that did not ask for usage (a keyed one has by now: routing.admission.usage)."""
    if body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    return not (isinstance(options, dict) and options.get("include_usage") is True)


def _cached_tokens(usage: dict[str, Any] | None) -> int | None:
    details = usage.get("prompt_tokens_details") if usage is not None else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


class CacheCheckCollector(Collector):
    """The tallies and kv_aware's fallbacks, read at scrape time."""

    def __init__(self, check: CacheCheck, policies: Callable[[], Mapping[str, BasePolicy]]) -> None:
        self.check, self.policies = check, policies

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        tallies = self.check.tallies
        labels = ["model", "policy"]
        errors = HistogramMetricFamily(
            "controlpanel_router_cache_prediction_error_tokens",
            "|predicted - reported| cached prompt tokens of checked requests.",
            labels=labels,
        )
        families = {
            "within_block": CounterMetricFamily(
                "controlpanel_router_cache_predictions_within_block",
                "Checked requests whose predicted cached tokens were within one block.",
                labels=labels,
            ),
            "predicted": CounterMetricFamily(
                "controlpanel_router_cache_predicted_tokens",
                "Cached prompt tokens the policy predicted, over checked requests.",
                labels=labels,
            ),
            "reported": CounterMetricFamily(
                "controlpanel_router_cache_reported_tokens",
                "Cached prompt tokens the workers reported, over checked requests.",
                labels=labels,
            ),
            "unchecked": CounterMetricFamily(
                "controlpanel_router_cache_predictions_unchecked",
                "Predictions whose answer carried no usage.prompt_tokens_details.cached_tokens.",
                labels=labels,
            ),
        }
        for (model, policy), tally in tallies.items():
            errors.add_metric([model, policy], tally.errors.cumulative(), tally.errors.total)
            for name, family in families.items():
                family.add_metric([model, policy], getattr(tally, name))
        yield errors
        yield from families.values()
        yield self._fallbacks()

    def _fallbacks(self) -> Metric:
        family = CounterMetricFamily(
            "controlpanel_router_kv_aware_fallbacks",
            "kv_aware requests routed (in part) on the approximate index, by reason: "
            "no_tokens, unknown_index (a worker without a known exact index).",
            labels=["model", "reason"],
        )
        for model, policy in self.policies().items():
            for reason, count in getattr(policy, "fallbacks", {}).items():
                family.add_metric([model, reason], count)
        return family
