"""The probes' parse memo (controlpanel.fleet.scrape_memo): on real vLLM 0.32 pages and the
recorded ones, page after page, the memo's families are exactly the whole page's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from controlpanel.fleet import probes, scrape_memo
from routing.telemetry import prom_text
from routing.telemetry.vllm_metrics import vllm_text
from tests.support.common import ROOT
from tests.support.recorded_metrics import RECORDED_NEW, RECORDED_OLD

CAPTURES = [
    ROOT / "tests/data/vllm-captures/metrics-tiny.txt",
    ROOT.parent / "shared/vllm-captures/metrics-smollm2.txt",
    ROOT.parent / "shared/vllm-captures/metrics-tiny.txt",
]
PAGES = [path.read_text() for path in CAPTURES if path.exists()] + [RECORDED_NEW, RECORDED_OLD]


@pytest.fixture(autouse=True)
def empty_memo() -> Iterator[None]:
    scrape_memo.forget()
    yield
    scrape_memo.forget()


def busier(text: str) -> str:
    """The same page after some traffic: the first `vllm:` samples changed, the rest as it was."""
    lines = text.splitlines()
    changed = 0
    for i, line in enumerate(lines):
        if line.startswith("vllm:") and changed < 3:
            lines[i] = line.rsplit(" ", 1)[0] + f" {changed + 5}"
            changed += 1
    return "\n".join(lines) + "\n"


def first_half(text: str) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(lines[: len(lines) // 2])


@pytest.mark.parametrize("page", PAGES, ids=range(len(PAGES)))
def test_page_after_page_the_memo_reads_as_the_whole_page(page: str) -> None:
    sequence = [page, page, busier(page), page, vllm_text(page), first_half(page), page]
    for text in sequence:
        assert scrape_memo.families(7, text) == prom_text.parse(text)
        assert probes.parse_scrape(text, worker=7) == probes.parse_scrape(text)


def test_the_real_pages_are_read_by_the_fast_reader_and_cut_per_family() -> None:
    page = vllm_text(PAGES[0])
    chunks = list(scrape_memo.chunks(page))
    assert len(chunks) > 20 and "\n".join(chunks) == page.rstrip("\n")
    assert scrape_memo.families(1, page) is not None


def test_unchanged_families_are_not_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    page = vllm_text(PAGES[0])
    scrape_memo.families(1, page)
    parsed: list[str] = []
    real = prom_text.parse

    def counting(text: str) -> object:
        parsed.append(text)
        return real(text)

    monkeypatch.setattr(prom_text, "parse", counting)
    assert scrape_memo.families(1, page) == real(page)
    assert parsed == []
    changed = page.replace("vllm:num_requests_waiting{", 'vllm:num_requests_waiting{y="2",', 1)
    assert scrape_memo.families(1, changed) == real(changed)
    assert len(parsed) == 1 and "vllm:num_requests_waiting" in parsed[0]


@pytest.mark.parametrize(
    "text",
    [
        "# HELP a x\n# TYPE a gauge\na 1\nb 2\n# HELP a y\n# TYPE a counter\na_total 3\n",
        'stray 1\n# HELP a\tdoc\n# TYPE a gauge\na 1\n# TYPE b histogram\nb_bucket{le="1"} 1\n',
        "# HELP a x\n# weird comment\na 1\n",
        "<html>not prometheus</html>\n",
        "",
    ],
)
def test_odd_texts_read_as_the_whole_text(text: str) -> None:
    for _ in range(2):
        assert scrape_memo.families(3, text) == prom_text.parse(text)


def test_at_most_max_workers_pages_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scrape_memo, "MAX_WORKERS", 3)
    for worker in range(5):
        scrape_memo.families(worker, RECORDED_NEW)
    scrape_memo.families(2, RECORDED_NEW)  # the most recently probed stays longest
    assert list(scrape_memo._pages) == [3, 4, 2]


def test_pages_are_kept_only_when_readable() -> None:
    scrape_memo.families(1, RECORDED_NEW)
    assert scrape_memo.families(1, "# HELP a x\n# bad\n") is None
    assert 1 not in scrape_memo._pages
