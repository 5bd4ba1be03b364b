"""A fast reader of Prometheus' text format, for the probe's scrapes of vLLM's `/metrics`.

prometheus_client's parser walks every character in Python: about 21 µs a line, 7.8 ms for
one real vLLM 0.32 scrape even after `vllm_metrics.vllm_text` drops the lines nobody reads,
so probing a fleet cost a Celery worker more CPU than anything else it did while idle. This
reader takes each line with one regular expression and gives the same families (name, type,
help, samples; counters named without `_total` as prometheus_client names them).

It understands only the common shape: `# HELP`, `# TYPE`, and samples of plain names with
quoted labels and an optional timestamp. On anything else (another comment, quoted metric
names, a line it cannot read) :func:`parse` returns None, and the caller parses the text with
prometheus_client, which is laxer and raises where the text is not Prometheus at all.
"""

from __future__ import annotations

import re

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
# No timestamp: vLLM writes none, and prometheus_client's reading of one is left to it.
_SAMPLE = re.compile(rf"({_NAME})(?:\{{(.*)\}})?[ \t]+(\S+)")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_COMMENT = re.compile(rf"# (HELP|TYPE) ({_NAME})(?:[ \t]+(.*))?")
_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "summary": ("_count", "_sum", ""),
    "histogram": ("_count", "_sum", "_bucket"),
}
_LABEL_ESCAPES = re.compile(r'\\[\\n"]')
_HELP_ESCAPES = re.compile(r"\\[\\n]")
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


class _Unreadable(Exception):
    """A line this reader does not understand: the caller falls back to prometheus_client."""


def parse(text: str) -> list[Metric] | None:
    """The families of `text`, or None when it holds a line this reader cannot read."""
    try:
        return _Families(text).read()
    except _Unreadable:
        return None


class _Families:
    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        self.out: list[Metric] = []
        self._open("")

    def read(self) -> list[Metric]:
        for raw in self.lines:
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                self._comment(line)
            else:
                self._sample(line)
        self._close()
        return self.out

    def _open(self, name: str, documentation: str = "") -> None:
        self.name, self.documentation, self.typ = name, documentation, "untyped"
        self.samples: list[Sample] = []
        self.allowed: tuple[str, ...] = (name,)

    def _close(self) -> None:
        if self.name:
            self.out.append(_metric(self.name, self.documentation, self.typ, self.samples))

    def _comment(self, line: str) -> None:
        match = _COMMENT.fullmatch(line)
        if match is None:
            raise _Unreadable
        kind, name, rest = match.groups()
        if name != self.name:
            self._close()
            self._open(name)
        if kind == "HELP":
            self.documentation = _unescape_help(rest or "")
        elif rest is None:
            raise _Unreadable
        else:
            self.typ = rest.strip()
            self.allowed = tuple(name + s for s in _SUFFIXES.get(self.typ, ("",)))

    def _sample(self, line: str) -> None:
        sample = _read_sample(line)
        if sample.name in self.allowed:
            self.samples.append(sample)
            return
        # A sample outside the open family is a family of its own, as prometheus_client has it.
        self._close()
        self._open("")
        self.out.append(_metric(sample.name, "", "untyped", [sample]))


def _read_sample(line: str) -> Sample:
    match = _SAMPLE.fullmatch(line)
    if match is None:
        raise _Unreadable
    name, body, value = match.groups()
    return Sample(name, _labels(body) if body else {}, _number(value))


def _number(value: str) -> float:
    """An int where the text is one, as prometheus_client reads it."""
    if "_" in value:  # int() and float() take "1_000"; the format does not
        raise _Unreadable
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        raise _Unreadable from None


def _labels(body: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    at = 0
    while at < len(body):
        match = _LABEL.match(body, at)
        if match is None or match.end() == at:
            raise _Unreadable
        key, value = match.groups()
        if key in labels or key == "__name__":
            raise _Unreadable
        labels[key] = _LABEL_ESCAPES.sub(_unescape, value) if "\\" in value else value
        at = match.end()
    return labels


def _unescape(match: re.Match[str]) -> str:
    return _UNESCAPED[match.group(0)]


def _unescape_help(text: str) -> str:
    return _HELP_ESCAPES.sub(_unescape, text) if "\\" in text else text


def _metric(name: str, documentation: str, typ: str, samples: list[Sample]) -> Metric:
    """As prometheus_client builds it: a counter's family drops `_total`, or its samples
    gain it."""
    if typ == "counter":
        if name.endswith("_total"):
            name = name[:-6]
        else:
            samples = [Sample(s.name + "_total", *s[1:]) for s in samples]
    metric = Metric(name, documentation, typ)
    metric.samples = samples
    return metric
