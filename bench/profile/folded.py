"""py-spy's folded stacks ("frame;frame;frame count" per line) as two tables: each function's
own samples and the samples it appears in, turned into µs per request."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

LINE = re.compile(r":\d+\)$")  # a frame's line number: functions are counted whole
TOP = 25


def frame_name(frame: str) -> str:
    """ "handle (routing/proxy.py:120)" -> "handle (routing/proxy.py)", paths from the
    site-packages or the checkout shortened to the module's own."""
    name = LINE.sub(")", frame.strip())
    for marker in ("site-packages/", "/work/", "/main/"):
        if marker in name:
            head, _, tail = name.partition("(")
            name = f"{head}({tail.rsplit(marker, 1)[-1]}"
    return name


@dataclass
class Table:
    total: int
    own: Counter[str]
    inclusive: Counter[str]
    us_per_request: float

    def us(self, samples: int) -> float:
        return samples / self.total * self.us_per_request if self.total else 0.0

    def record(self) -> dict[str, Any]:
        return {
            "samples": self.total,
            "us_per_request": self.us_per_request,
            "own": dict(self.own.most_common(200)),
            "inclusive": dict(self.inclusive.most_common(200)),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Table:
        own, inclusive = Counter(record["own"]), Counter(record["inclusive"])
        return cls(record["samples"], own, inclusive, record["us_per_request"])


def fold(text: str, us_per_request: float) -> Table:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";")]
        if frames and frames[0].startswith("process "):
            frames = frames[1:]  # py-spy's leading process and thread frames
        if frames and frames[0].startswith("thread "):
            frames = frames[1:]
        total += n
        if frames:
            own[frames[-1]] += n
        for name in set(frames):
            inclusive[name] += n
    return Table(total, own, inclusive, us_per_request)


def markdown(name: str, us_per_request: float, table: Table) -> str:
    lines = [
        f"### {name}: {us_per_request:.0f} µs of router CPU per request, {table.total} samples",
        "",
        "| own µs/req | function | | inclusive µs/req | function |",
        "|--:|---|---|--:|---|",
    ]
    mine = table.own.most_common(TOP)
    held = [(k, v) for k, v in table.inclusive.most_common(TOP * 3)][:TOP]
    for (a, na), (b, nb) in zip(mine, held, strict=False):
        lines.append(f"| {table.us(na):.1f} | `{a}` | | {table.us(nb):.1f} | `{b}` |")
    return "\n".join([*lines, ""])


# Own time by package: the first marker found in a frame's file decides (py-spy charges C
# code, uvloop's loop and httptools included, to the Python frame that called it).
PACKAGES = (
    ("the project", ("routing/", "controlpanel/", "bench/")),
    ("aiohttp (with multidict, yarl)", ("aiohttp/", "multidict/", "yarl/")),
    ("uvicorn", ("uvicorn/",)),
    ("asyncio and uvloop's loop", ("asyncio/", "uvloop/")),
    ("logging", ("logging/",)),
    ("Django", ("django/",)),
)
OTHER = "other"


def package(frame: str) -> str:
    where = frame.rpartition("(")[2]
    for name, markers in PACKAGES:
        if any(m in where for m in markers):
            return name
    return OTHER


def by_package(table: Table) -> Counter[str]:
    grouped: Counter[str] = Counter()
    for frame, n in table.own.items():
        grouped[package(frame)] += n
    return grouped


def package_us(table: Table) -> dict[str, float]:
    """Own µs per request by package, from the full table (a record keeps only the top)."""
    grouped = by_package(table)
    return {n: table.us(grouped[n]) for n in [*(n for n, _ in PACKAGES), OTHER]}


def packages_markdown(name: str, packages: dict[str, float]) -> str:
    shares = ", ".join(f"{n} {us:.1f}" for n, us in packages.items())
    return f"{name}, own µs per request by package: {shares}\n"
