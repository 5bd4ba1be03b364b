"""vLLM's own series, re-exported under their own names with a `worker` label.

A dashboard or alert written for vLLM (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
the token counters, the TTFT and inter-token latency histograms, ...) then works through the
router once `worker` is added to its legends and `by` clauses. Our curated
`controlpanel_worker_*` gauges stay beside them (routing.telemetry.metrics).

Two halves:

* **Keeping** (:func:`kept_series`, run by the control plane's probe, off the request
  path): from the families of one worker's `/metrics`, every sample whose family name starts
  with `vllm:`, as plain JSON (family -> [type, help, [[sample name, labels, value], ...]]),
  stored with the worker's other scraped values. At most :data:`MAX_SAMPLES_PER_WORKER`
  samples per worker: families are kept whole, in name order, and one that does not fit in
  what is left is dropped whole, so one misbehaving family (a label with a value per
  request) cannot grow everyone's `/metrics` without bound, nor push out the others.
* **Re-exporting** (:func:`vllm_families`, at scrape time): one family per name over all
  workers, each sample with the worker's label first. A sample that already has a `worker`
  label keeps it as `exported_worker`, as Prometheus does for clashing target labels. A
  worker whose family has another type than the first worker's (two vLLM versions) is left
  out of that family rather than mixing types.

What is exported is the last probe's reading (every CONTROLPANEL_PROBE_INTERVAL seconds):
counters and histograms are vLLM's own cumulative values, so `rate()` works on them as on
vLLM scraped directly. A worker whose last scrape failed has no `vllm:` series at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import Metric

from routing.fleet.snapshot import WorkerView

PREFIX = "vllm:"
# The scraped value (WorkerView.metrics) under which a worker's kept series are stored.
SERIES_KEY = "vllm_series"
# A real vLLM engine exports a few hundred samples (about 15 histograms of 10-30 buckets);
# past this, families that do not fit are dropped whole.
MAX_SAMPLES_PER_WORKER = 1000
WORKER_LABEL = "worker"
_CLASHING_LABEL = "exported_worker"

# prometheus_client's creation time of every counter and histogram, which vLLM exports as
# gauge families of their own (44 per engine in 0.32): a time, not a reading, left out.
CREATED = "_created"
# Info gauges whose value is the time their labels were set: vLLM adds a series each time
# the labels change (lora_requests_info: each set of running and waiting adapters) and never
# removes the old ones, so only the latest (the highest value) says how things are now.
LATEST_ONLY = frozenset({"vllm:lora_requests_info"})

# family name -> [type, help, [[sample name, labels, value], ...]], JSON as stored.
KeptSeries = dict[str, list[Any]]


def kept_series(families: Iterable[Metric]) -> KeptSeries:
    """The `vllm:` families of one scrape, bounded; non-finite values are dropped, since
    they carry no reading and JSON cannot hold them (and a family left empty with them)."""
    kept: KeptSeries = {}
    room = MAX_SAMPLES_PER_WORKER
    for family in sorted(families, key=lambda f: f.name):
        if not family.name.startswith(PREFIX) or family.name.endswith(CREATED):
            continue
        readings = [
            s for s in family.samples if _finite(float(s.value)) and not s.name.endswith(CREATED)
        ]
        if family.name in LATEST_ONLY and readings:
            readings = [max(readings, key=lambda s: float(s.value))]
        samples = [[s.name, dict(s.labels), float(s.value)] for s in readings]
        if not samples or len(samples) > room:
            continue
        room -= len(samples)
        kept[family.name] = [family.type, family.documentation, samples]
    return kept


def vllm_text(text: str) -> str:
    """Only the lines of `vllm:` families, without their `_created` series: all that the
    probe reads or keeps. Real vLLM 0.32 exports about 700 lines, 200 of them the Python
    process's own and 150 creation times; prometheus_client's parser walks every character,
    so this cut halves a probe's CPU. "" when the text has no `vllm:` line at all."""
    kept = [line for line in text.splitlines() if _is_vllm_line(line)]
    return "\n".join(kept) + "\n" if kept else ""


def _is_vllm_line(line: str) -> bool:
    if line.startswith(("# HELP ", "# TYPE ")):
        name = line[7:].split(" ", 1)[0]
    elif line.startswith(PREFIX):
        name = line.split("{", 1)[0].split(" ", 1)[0]
    else:
        return False
    return name.startswith(PREFIX) and not name.endswith(CREATED)


def _finite(value: float) -> bool:
    return value == value and value not in (float("inf"), float("-inf"))


def vllm_families(
    workers: Iterable[WorkerView], label: Callable[[int | None], str]
) -> Iterator[Metric]:
    """One family per `vllm:` name, with the samples of every worker that reported it."""
    merged: dict[str, Metric] = {}
    for worker in workers:
        series = worker.metrics.get(SERIES_KEY)
        if isinstance(series, Mapping):
            _merge(merged, series, label(worker.id))
    for name in sorted(merged):
        yield merged[name]


def _merge(merged: dict[str, Metric], series: Mapping[str, Any], worker: str) -> None:
    for name, (kind, documentation, samples) in series.items():
        family = merged.get(name)
        if family is None:
            family = merged[name] = Metric(name, documentation, kind)
        elif family.type != kind:
            continue
        for sample_name, labels, value in samples:
            family.add_sample(sample_name, _with_worker(labels, worker), value)


def _with_worker(labels: Mapping[str, str], worker: str) -> dict[str, str]:
    out = {WORKER_LABEL: worker}
    for key, value in labels.items():
        out[_CLASHING_LABEL if key == WORKER_LABEL else key] = value
    return out
