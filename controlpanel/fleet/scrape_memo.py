"""Each worker's last /metrics page, remembered so the families that did not change since the
last probe are not parsed again.

vLLM's `vllm:` lines are read every probe round (``probes.parse_scrape``), and on an idle
worker, or a busy one between two scrapes, most of its families read the same as last time:
the cache config, the histograms of a model nobody asked, the LoRA info. So the text is cut
into **chunks, one per family** (a chunk starts at a `# HELP` or `# TYPE` line whose name
differs from the previous such line's), and each chunk's families from the fast reader
(``routing.telemetry.prom_text``) are kept by the chunk's text. The next page's chunks that
are byte for byte the same take their families from there; only the others are parsed.

**Exactly the same result as parsing the whole page.** At such a line the reader closes the
family it had open (or had none open, after a sample of no family), so it starts it as a
fresh reader would: the families of the chunks, in order, are those of the whole text. A line
the reader cannot read makes the whole page unreadable, as :func:`prom_text.parse` says
(None), since that is decided line by line. The families handed out are shared with the
memo: callers read them and never change them (``probes.collect_samples``,
``vllm_metrics.kept_series`` copy what they keep).

**Bounded.** At most :data:`MAX_WORKERS` workers' pages (the least recently probed go first);
per worker only the last page's chunks, a few hundred parsed samples (tens of KiB).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterator

from prometheus_client.core import Metric

from routing.telemetry import prom_text

MAX_WORKERS = 128
# The name of a `# HELP` or `# TYPE` line, as prom_text reads it.
_COMMENT_NAME = re.compile(r"# (?:HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*)(?:[ \t]|$)")

_lock = threading.Lock()  # Celery's threads probe one round at a time, but may overlap
_pages: OrderedDict[object, dict[str, list[Metric]]] = OrderedDict()


def families(worker: object, text: str) -> list[Metric] | None:
    """``prom_text.parse(text)``, parsing only the chunks that differ from `worker`'s last
    page; None when the fast reader cannot read the text (nothing is remembered then)."""
    with _lock:
        last = _pages.pop(worker, {})
    now: dict[str, list[Metric]] = {}
    out: list[Metric] = []
    for chunk in chunks(text):
        parsed = now.get(chunk) if chunk in now else last.get(chunk)
        if parsed is None:
            parsed = prom_text.parse(chunk)
            if parsed is None:
                return None
        now[chunk] = parsed
        out.extend(parsed)
    _remember(worker, now)
    return out


def _remember(worker: object, page: dict[str, list[Metric]]) -> None:
    with _lock:
        _pages[worker] = page
        _pages.move_to_end(worker)
        while len(_pages) > MAX_WORKERS:
            _pages.popitem(last=False)


def forget(worker: object | None = None) -> None:
    """Drop one worker's page, or every page (tests)."""
    with _lock:
        if worker is None:
            _pages.clear()
        else:
            _pages.pop(worker, None)


def chunks(text: str) -> Iterator[str]:
    """The text cut before every `# HELP`/`# TYPE` line that names another family than the
    previous such line: one chunk per family, as the reader groups them."""
    lines: list[str] = []
    named = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and (match := _COMMENT_NAME.match(stripped)):
            if match.group(1) != named and lines:
                yield "\n".join(lines)
                lines = []
            named = match.group(1)
        lines.append(line)
    if lines:
        yield "\n".join(lines)
