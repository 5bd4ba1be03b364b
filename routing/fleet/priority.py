"""Priority classes: which of a request's three classes applies, from its key and header.

The classes are the Gateway API Inference Extension's: `critical`, `standard` (the default)
and `sheddable`. A key has one (`priority` on /api/keys); a request may lower its own class
with `X-Priority`, never raise it above its key's (a request that asks is given its key's
class, and the capping is counted). With client keys off, the header alone decides.
"""

from __future__ import annotations

CRITICAL, STANDARD, SHEDDABLE = "critical", "standard", "sheddable"
PRIORITIES = (CRITICAL, STANDARD, SHEDDABLE)  # highest first
RANK = {name: rank for rank, name in enumerate(PRIORITIES)}  # 0: the highest
HEADER = b"x-priority"


class UnknownClass(ValueError):
    pass


def request_rank(asked: str | None, ceiling: str | None) -> tuple[int, bool]:
    """The rank (0: critical) a request runs at, and whether its ask was capped: `asked` is
    its X-Priority header (None: none), `ceiling` its key's class (None: keys are off)."""
    if asked is None:
        return RANK[ceiling or STANDARD], False
    rank = RANK.get(asked.strip().lower())
    if rank is None:
        raise UnknownClass(
            f"unknown priority class {asked!r} in X-Priority; use one of {', '.join(PRIORITIES)}"
        )
    if ceiling is not None and rank < RANK[ceiling]:
        return RANK[ceiling], True
    return rank, False
