"""Priority classes (routing.fleet.priority): which class a request runs at, from its
X-Priority header and its key's class. How admission uses them:
tests/unit/routing/admission/test_priority.py."""

from __future__ import annotations

import pytest

from routing.fleet.priority import PRIORITIES, RANK, UnknownClass, request_rank


def test_classes_rank_from_critical_down() -> None:
    assert PRIORITIES == ("critical", "standard", "sheddable")
    assert [RANK[name] for name in PRIORITIES] == [0, 1, 2]


@pytest.mark.parametrize(
    ("asked", "ceiling", "expected"),
    [
        (None, None, (1, False)),  # keys off, no header: standard
        (None, "sheddable", (2, False)),  # the key's own class
        ("STANDARD", "standard", (1, False)),
        ("sheddable", "standard", (2, False)),  # lowering is always allowed
        ("critical", "sheddable", (2, True)),  # raising is capped, and said so
        ("critical", None, (0, False)),  # keys off: the header decides
    ],
)
def test_a_request_may_lower_its_class_never_raise_it(
    asked: str | None, ceiling: str | None, expected: tuple[int, bool]
) -> None:
    assert request_rank(asked, ceiling) == expected


def test_an_unknown_class_names_the_known_ones() -> None:
    with pytest.raises(UnknownClass, match="use one of critical, standard, sheddable"):
        request_rank("high", "critical")
