"""Probing vLLM servers and reading their Prometheus metrics, with no database access.

Two halves, kept apart on purpose:

* **I/O.** :func:`probe_many` asks every worker at once (``asyncio.gather`` over the
  process's one ``aiohttp.ClientSession`` and event loop, kept between rounds:
  :mod:`controlpanel.fleet.probe_session`), and each worker's requests run side by side
  under one deadline, so a server that accepts and never answers costs the round one
  timeout, not one per worker or per endpoint. It returns plain :class:`ProbeResult`
  values; the caller applies them with the ORM after the loop has run, never inside it.
* **Parsing.** :func:`read_metrics` is a pure function of the ``/metrics`` text, the previous
  scrape's raw counters and the scrape time, so it is tested on recorded samples. Rates (the
  prefix-cache hit rate, requests per second, recent TTFT quantiles) are *deltas between two
  scrapes*: vLLM's counters count since the engine started, and a lifetime average would hide
  what the engine does now. A counter that went down means the engine restarted; the delta is
  then the new count, as Prometheus' ``rate()`` does.

Whatever the server does not export stays ``None``. A made-up zero would read as "idle" or
"no cache hits", and the router would send more traffic to a server it knows nothing about.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
import ssl
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from controlpanel.fleet import scrape_memo
from routing.telemetry import prom_text
from routing.telemetry.vllm_metrics import SERIES_KEY, KeptSeries, kept_series, vllm_text

if TYPE_CHECKING:
    import aiohttp

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
# Each list is tried in order; the first name present wins, and names are never mixed, so a
# server exporting both during a deprecation period is not counted twice.
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_COUNTERS = (
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
    ("vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"),
)
REQUEST_SUCCESS = "vllm:request_success_total"
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
SLEEP_STATE = "vllm:engine_sleep_state"

METRIC_KEYS = (
    "running",
    "waiting",
    "kv_cache_usage",
    "prefix_hit_rate",
    "ttft_p50",
    "ttft_p95",
    "rps",
    # vLLM's own series as scraped, re-exported by the router (routing.telemetry.vllm_metrics)
    SERIES_KEY,
)
# Raw readings kept in Worker.scrape_state for the next probe's deltas.
COUNTER_KEYS = ("at", "prefix_queries", "prefix_hits", "requests", "ttft_buckets")

# Workers probed at the same moment; more wait for a free slot, so a huge fleet cannot use
# up the process's file descriptors. Each probed worker holds up to four connections
# (/health, /metrics, /v1/models and its DCGM exporter): probe_session's limits.
MAX_CONCURRENT_WORKERS = 128


# --- parsing (pure) --------------------------------------------------------------------------


@dataclass(frozen=True)
class Scrape:
    """One /metrics text, reduced to the raw values the probes use (None: not exported)."""

    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    requests: float | None = None
    ttft_buckets: dict[str, float] | None = None  # cumulative count per `le`, summed
    sleeping: bool | None = None
    vllm_series: KeptSeries | None = None


@dataclass(frozen=True)
class MetricsReading:
    metrics: dict[str, Any]  # METRIC_KEYS, each possibly None
    counters: dict[str, Any]  # COUNTER_KEYS, for the next probe
    sleeping: bool | None  # None: the server does not say


Samples = dict[str, list[tuple[dict[str, str], float]]]


def collect_samples(families: Iterable[Metric]) -> Samples:
    """Every sample by its exposed name (counters keep `_total`, histograms their `_bucket`),
    whatever family the parser put it in."""
    samples: Samples = defaultdict(list)
    for family in families:
        for sample in family.samples:
            value = float(sample.value)
            # NaN and infinities carry no reading, and JSON columns cannot store them.
            if math.isfinite(value):
                samples[sample.name].append((dict(sample.labels), value))
    return samples


def parse_scrape(text: str, *, worker: int | None = None) -> Scrape | None:
    """None when the text is not Prometheus at all (an HTML error page, a cut-off body).
    With `worker`, the families that read as in that worker's last page are not parsed
    again (scrape_memo); the result is the same."""
    # A server with no `vllm:` line at all is parsed whole, so what is not Prometheus still
    # reads as None rather than as an empty scrape.
    wanted = vllm_text(text) or text
    # Parsed once: the readings below and the kept vLLM series share the families.
    families = prom_text.parse(wanted) if worker is None else scrape_memo.families(worker, wanted)
    if families is None:  # a shape the fast reader leaves to prometheus_client
        try:
            families = list(text_string_to_metric_families(wanted))
        except ValueError:
            return None
    samples = collect_samples(families)
    queries, hits = _prefix_counters(samples)
    return Scrape(
        running=_sum(samples, RUNNING),
        waiting=_sum(samples, WAITING),
        kv_cache_usage=_first(_mean(samples, name) for name in KV_CACHE_USAGE),
        prefix_queries=queries,
        prefix_hits=hits,
        requests=_sum(samples, REQUEST_SUCCESS),
        ttft_buckets=_buckets(samples, TTFT_BUCKET),
        sleeping=_sleeping(samples),
        vllm_series=kept_series(families) or None,
    )


def _sum(samples: Samples, name: str) -> float | None:
    """Summed over label sets: one value per engine (data parallel) or per finish reason."""
    values = [value for _, value in samples.get(name, ())]
    return sum(values) if values else None


def _mean(samples: Samples, name: str) -> float | None:
    # Usage is a fraction per engine: averaging keeps it a fraction of the server's cache.
    values = [value for _, value in samples.get(name, ())]
    return sum(values) / len(values) if values else None


def _first(values: Iterable[float | None]) -> float | None:
    return next((v for v in values if v is not None), None)


def _prefix_counters(samples: Samples) -> tuple[float | None, float | None]:
    for queries_name, hits_name in PREFIX_COUNTERS:
        if queries_name in samples or hits_name in samples:
            return _sum(samples, queries_name), _sum(samples, hits_name)
    return None, None


def _le_key(le: str) -> str:
    """One spelling per bound ("0.10" and "0.1" are the same bucket)."""
    bound = float(le)
    return "+Inf" if math.isinf(bound) else repr(bound)


def _buckets(samples: Samples, name: str) -> dict[str, float] | None:
    totals: dict[str, float] = defaultdict(float)
    for labels, value in samples.get(name, ()):
        if "le" in labels:
            totals[_le_key(labels["le"])] += value
    return dict(totals) or None


def _sleeping(samples: Samples) -> bool | None:
    """vLLM exports one sample per `sleep_state` label: awake=1 means awake, and
    weights_offloaded=1 or discard_all=1 means asleep (levels 1 and 2). A sample without
    that label is read as "a value above zero means sleeping"."""
    found = samples.get(SLEEP_STATE)
    if not found:
        return None
    return any(_says_asleep(labels.get("sleep_state"), value) for labels, value in found)


def _says_asleep(state: str | None, value: float) -> bool:
    if state == "awake":
        return value == 0
    return value > 0


def read_metrics(
    text: str | None, *, previous: Mapping[str, Any], at: float, worker: int | None = None
) -> MetricsReading:
    """The metrics to show and route on, and the counters the next probe needs.

    `previous` is the last probe's counters (Worker.scrape_state); `at` the scrape time in
    epoch seconds; `worker` lets parse_scrape reuse that worker's unchanged families.
    Without readable text (the request failed, or the answer was not Prometheus) every
    metric is None and the previous counters are kept, so the next delta simply spans two
    intervals.
    """
    scrape = None if text is None else parse_scrape(text, worker=worker)
    if scrape is None:
        kept = {key: previous.get(key) for key in COUNTER_KEYS}
        return MetricsReading(metrics=dict.fromkeys(METRIC_KEYS), counters=kept, sleeping=None)
    p50, p95 = ttft_quantiles(scrape.ttft_buckets, previous.get("ttft_buckets"))
    metrics = {
        "running": _count(scrape.running),
        "waiting": _count(scrape.waiting),
        "kv_cache_usage": scrape.kv_cache_usage,
        "prefix_hit_rate": prefix_hit_rate(scrape, previous),
        "ttft_p50": p50,
        "ttft_p95": p95,
        "rps": requests_per_second(scrape.requests, previous, at=at),
        SERIES_KEY: scrape.vllm_series,
    }
    counters = {
        "at": at,
        "prefix_queries": scrape.prefix_queries,
        "prefix_hits": scrape.prefix_hits,
        "requests": scrape.requests,
        "ttft_buckets": scrape.ttft_buckets,
    }
    return MetricsReading(metrics=metrics, counters=counters, sleeping=scrape.sleeping)


def _count(value: float | None) -> int | None:
    return None if value is None else round(value)


def counter_delta(current: float | None, previous: Any) -> float | None:
    """Growth since the previous reading; a counter that went down was reset (the engine
    restarted), so all of its current value is new."""
    if current is None or not isinstance(previous, int | float):
        return None
    return current if current < previous else current - previous


def prefix_hit_rate(scrape: Scrape, previous: Mapping[str, Any]) -> float | None:
    """Hits / queries among the tokens looked up since the previous probe."""
    prev_queries, prev_hits = previous.get("prefix_queries"), previous.get("prefix_hits")
    if scrape.prefix_queries is None or scrape.prefix_hits is None:
        return None
    if not isinstance(prev_queries, int | float) or not isinstance(prev_hits, int | float):
        return None
    if scrape.prefix_queries < prev_queries or scrape.prefix_hits < prev_hits:
        # Both counters restart together; judge them together.
        queries, hits = scrape.prefix_queries, scrape.prefix_hits
    else:
        queries, hits = scrape.prefix_queries - prev_queries, scrape.prefix_hits - prev_hits
    if queries <= 0:
        return None
    return min(1.0, max(0.0, hits / queries))


def requests_per_second(
    requests: float | None, previous: Mapping[str, Any], *, at: float
) -> float | None:
    delta = counter_delta(requests, previous.get("requests"))
    prev_at = previous.get("at")
    if delta is None or not isinstance(prev_at, int | float) or at <= prev_at:
        return None
    return delta / (at - prev_at)


def ttft_quantiles(
    current: Mapping[str, float] | None, previous: Any
) -> tuple[float | None, float | None]:
    """p50 and p95 of the time to first token among the requests that got their first
    token since the previous probe, from the growth of each histogram bucket."""
    if not current or not isinstance(previous, dict) or set(previous) != set(current):
        # First probe, or the server changed its buckets: no common baseline.
        return None, None
    deltas = {le: count - float(previous[le]) for le, count in current.items()}
    if any(delta < 0 for delta in deltas.values()):
        deltas = dict(current)  # reset: everything counted is new
    ordered = sorted((float(le), count) for le, count in deltas.items())
    return histogram_quantile(0.5, ordered), histogram_quantile(0.95, ordered)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' estimate from cumulative (upper bound, count) pairs sorted by bound:
    linear interpolation inside the bucket that holds the rank. A rank in the +Inf bucket
    answers the highest finite bound, as Prometheus does. None without observations."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


# --- probing (async I/O) ---------------------------------------------------------------------


def worker_auth(api_key: str) -> dict[str, str]:
    """The header a vLLM server started with --api-key wants on its /v1 paths; none without."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class ProbeTarget:
    worker_id: int
    url: str
    read_models: bool  # /v1/models is read every CONTROLPANEL_MODELS_EVERY probes
    dcgm_url: str = ""  # the worker's DCGM exporter, scraped with the rest when set
    api_key: str = ""  # vLLM's --api-key guards /v1/models (not /health, /metrics)


@dataclass(frozen=True)
class ProbeResult:
    worker_id: int
    at: float  # epoch seconds when the probe started: the scrape time for rates
    up: bool  # /health answered 200
    error: str  # why the probe failed ("" when up)
    metrics_text: str | None  # None: /metrics could not be read
    models_read: bool  # /v1/models was asked for
    models_payload: Any = None  # its JSON when it answered 200
    models_error: str = ""
    dcgm_text: str | None = None  # the DCGM exporter's text (None: none set, or unreadable)
    dcgm_error: str = ""


def probe_many(targets: list[ProbeTarget], *, timeout: float) -> list[ProbeResult]:
    """Probe every target concurrently; returns within about `timeout` for a fleet of up to
    MAX_CONCURRENT_WORKERS, however many of them hang."""
    if not targets:
        return []
    # Here: the router imports this module (worker_auth) and never probes.
    from controlpanel.fleet import probe_session

    return probe_session.run(_probe_all(targets, timeout=timeout))


async def _probe_all(targets: list[ProbeTarget], *, timeout: float) -> list[ProbeResult]:
    from controlpanel.fleet import probe_session  # loaded by probe_many already: a lookup

    client = await probe_session.session(tls=tls_context())
    slots = asyncio.Semaphore(min(len(targets), MAX_CONCURRENT_WORKERS))
    return list(await asyncio.gather(*(_probe_in_slot(client, t, slots, timeout) for t in targets)))


@cache
def tls_context() -> ssl.SSLContext:
    """The process's one TLS context for calls to workers (probes, discovery, /version,
    LoRA loads). Loading the CA bundle takes a tenth of a second and a few MiB of OpenSSL's
    memory: once per process, not per call (a fresh one per registration left the router's
    heap a few MiB larger each time, freed but fragmented)."""
    import httpx

    return httpx.create_ssl_context()


async def _probe_in_slot(
    client: aiohttp.ClientSession, target: ProbeTarget, slots: asyncio.Semaphore, timeout: float
) -> ProbeResult:
    async with slots:
        return await probe_one(client, target, timeout=timeout)


async def probe_one(
    client: aiohttp.ClientSession, target: ProbeTarget, *, timeout: float
) -> ProbeResult:
    at = time.time()
    requests = [
        _get(client, f"{target.url}/health", timeout),
        _get(client, f"{target.url}/metrics", timeout),
    ]
    if target.read_models:
        auth = worker_auth(target.api_key)
        requests.append(_get(client, f"{target.url}/v1/models", timeout, auth))
    if target.dcgm_url:
        requests.append(_get(client, target.dcgm_url, timeout))
    answers = await asyncio.gather(*requests)
    health, metrics = answers[0], answers[1]
    models = answers[2] if target.read_models else None
    dcgm = answers[-1] if target.dcgm_url else None
    return ProbeResult(
        worker_id=target.worker_id,
        at=at,
        up=health.status == 200,
        error=_health_error(health),
        metrics_text=metrics.text if metrics.status == 200 else None,
        models_read=target.read_models,
        models_payload=_json_or_none(models),
        models_error=_answer_error(models, "/v1/models") if models is not None else "",
        dcgm_text=dcgm.text if dcgm is not None and dcgm.status == 200 else None,
        dcgm_error=_answer_error(dcgm, "the DCGM exporter") if dcgm is not None else "",
    )


@dataclass(frozen=True)
class _Answer:
    status: int | None  # None: no HTTP answer at all
    text: str = ""
    error: str = ""


async def _get(
    client: aiohttp.ClientSession, url: str, timeout: float, headers: dict[str, str] | None = None
) -> _Answer:
    # One deadline for the whole request, connect to last byte, so a server that accepts
    # and never answers, or trickles its answer byte by byte, still cannot hold the round.
    import aiohttp  # loaded by probe_session already: a lookup

    try:
        async with asyncio.timeout(timeout):
            async with client.get(url, headers=headers, allow_redirects=False) as response:
                body = await response.read()
    except TimeoutError:  # aiohttp's own timeouts are TimeoutErrors too
        return _Answer(None, error=f"timed out after {timeout:g} s")
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        return _Answer(None, error=describe_error(exc))
    return _Answer(response.status, text=_decoded(body, response.charset))


def _decoded(body: bytes, charset: str | None) -> str:
    """The body as text, as httpx's `.text` read it: the declared charset, else UTF-8, and
    undecodable bytes replaced rather than failing the probe."""
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")


def describe_error(exc: Exception) -> str:
    """A short cause for an event message, in the words the probes always used (with httpx
    before): "connection refused", "cannot connect: ...", "connection closed: ..."."""
    import aiohttp  # loaded already: exc came from it

    text = str(exc).strip()
    if isinstance(exc, aiohttp.ClientConnectorError):
        if _refused(exc.os_error) or "refused" in text.lower():
            return "connection refused"
        return f"cannot connect: {text}"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return f"connection closed: {text}" if text else "connection closed"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _refused(error: OSError) -> bool:
    # Several addresses tried (IPv6 and IPv4) end in one OSError naming each errno.
    return _caused_by(error, ConnectionRefusedError) or error.errno == errno.ECONNREFUSED


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: BaseException | None = exc
    for _ in range(10):  # the chain is short; a bound keeps a cycle from looping forever
        if seen is None:
            return False
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _health_error(answer: _Answer) -> str:
    if answer.status == 200:
        return ""
    return _answer_error(answer, "/health")


def _answer_error(answer: _Answer, path: str) -> str:
    if answer.status is None:
        return answer.error
    return "" if answer.status == 200 else f"{path} answered HTTP {answer.status}"


def _json_or_none(answer: _Answer | None) -> Any:
    if answer is None or answer.status != 200:
        return None
    try:
        return json.loads(answer.text)
    except ValueError:
        return None
