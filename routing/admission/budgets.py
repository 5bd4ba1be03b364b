"""Token budgets per client key: prompt + completion tokens per UTC day and per UTC month.

A key's `daily_tokens` and `monthly_tokens` (routing.admission.auth.ClientKey, in the snapshot) cap
what the `usage` of its answers adds up to in the current period. The request path reads
memory only: `BudgetLedger.exhausted` compares the key's used count in each period with its
budget, and `charge` (called by routing.admission.auth once an answer's usage is known) adds the
tokens to this process's pending counts. So, per key and period,

    used = the shared counter as last read from Redis + what this process charged since.

Off the request path, every SYNC_SECONDS, routing.peers.fleet_sync's tick calls `sync`: one
pipelined round trip to Redis that adds every pending count to the deployment's counters
(INCRBY) and then reads the counters of every key with a budget (one MGET). The read
replaces what the process knew; charges made during the round trip stay pending and count
on top, so nothing is counted twice or lost. A failed round trip puts the pending counts
back, to be pushed when Redis answers again (one cut after Redis applied it, before its
answer came, counts them twice: an over-count, never an under-count).

Counters are named `controlpanel:<deployment>:budget:<key prefix>:day:2026-12-01` and
`...:month:2026-12`: by the key's public prefix (ids start again at 1 in a new database
sharing the Redis) and under the deployment's namespace, like routing.peers.fleet_sync's keys.
Each expires EXPIRE_AFTER past the end of its period (the dashboard may still read it). A
new period needs no reset: its counters have new names and start at zero. Every keyed
answer is counted, budget or not, so a budget given to a key in the middle of a day holds
that whole day's use.

A request is let in while used < budget, and refused once used >= budget (routing.admission.auth: a
429 naming the budget, Retry-After = the seconds to the reset). As with `tpm`, the tokens
are known only when an answer ends, so requests already running when a budget runs out
finish and are counted: a key can go past its budget by what its requests in flight use,
plus what other routers charged in the last SYNC_SECONDS. A changed budget arrives with the
snapshot and holds from the next request; a key given its first budget is read from Redis
at the next sync.

Without Redis, or while it is down, each process counts on its own (the last counts read
plus its own charges): with N routers a key can then use up to N times its budget, and a
router started without Redis starts from zero.

Periods are UTC, read from `now` (injectable, so tests can move to the next day).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis.asyncio.client import Pipeline

    from routing.fleet.client_keys import ClientKey

SYNC_SECONDS = 0.25
DAY, MONTH = "day", "month"
KINDS = (DAY, MONTH)
# How long a counter outlives its period: enough for the dashboard, and for a router whose
# clock runs a little behind, to still find it.
EXPIRE_AFTER = {DAY: timedelta(hours=6), MONTH: timedelta(days=2)}


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class Period:
    kind: str  # DAY or MONTH
    label: str  # "2026-12-01" or "2026-12"
    resets_at: datetime  # the start of the next period, UTC


def period_of(kind: str, now: datetime) -> Period:
    """The UTC day or month `now` falls in."""
    now = now.astimezone(UTC)
    if kind == DAY:
        start = datetime(now.year, now.month, now.day, tzinfo=UTC)
        return Period(DAY, start.strftime("%Y-%m-%d"), start + timedelta(days=1))
    following = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    return Period(MONTH, f"{now.year:04d}-{now.month:02d}", following)


def counter_name(namespace: str, prefix: str, period: Period) -> str:
    """The Redis key of one key's counter for one period (the control plane reads it too)."""
    return f"controlpanel:{namespace}:budget:{prefix}:{period.kind}:{period.label}"


def budgets_of(key: ClientKey) -> list[tuple[str, int]]:
    """(kind, budget) for each budget the key has."""
    limits = ((DAY, key.daily_tokens), (MONTH, key.monthly_tokens))
    return [(kind, budget) for kind, budget in limits if budget is not None]


@dataclass(frozen=True, slots=True)
class Exhausted:
    """A budget that is used up: what the refusal tells the client."""

    period: Period
    budget: int
    used: int

    def seconds_to_reset(self, now: datetime) -> int:
        return max(1, math.ceil((self.period.resets_at - now).total_seconds()))

    def message(self, prefix: str) -> str:
        name = "Daily" if self.period.kind == DAY else "Monthly"
        resets = self.period.resets_at.strftime("%Y-%m-%dT%H:%M:%SZ")
        return (
            f"{name} token budget of {self.budget} tokens for key {prefix} is used up "
            f"({self.used} used); it resets at {resets}."
        )


Slot = tuple[str, Period]  # (key prefix, period)


class BudgetLedger:
    """Every key's used tokens per period, as this process knows them."""

    def __init__(self, now: Callable[[], datetime] = utc_now) -> None:
        self.now = now
        self._read: dict[Slot, int] = {}  # the shared counters at the last sync
        self._pending: dict[Slot, int] = {}  # charged here and not yet added to Redis
        self._synced_at = 0.0  # time.monotonic() of the last sync
        self._today: Period | None = None  # to notice a new day, and forget ended periods
        self.refusals: dict[str, int] = {}  # period kind -> requests refused (/metrics)

    def used(self, prefix: str, period: Period) -> int:
        slot = (prefix, period)
        return self._read.get(slot, 0) + self._pending.get(slot, 0)

    def exhausted(self, key: ClientKey) -> Exhausted | None:
        """The first of the key's budgets that is used up now, or None. Memory only."""
        if key.daily_tokens is None and key.monthly_tokens is None:
            return None
        now = self.now()
        for kind, budget in budgets_of(key):
            period = period_of(kind, now)
            used = self.used(key.prefix, period)
            if used >= budget:
                return Exhausted(period, budget, used)
        return None

    def charge(self, prefix: str, tokens: int) -> None:
        """Count an answer's tokens in the current day and month (pushed by the next sync)."""
        now = self.now()
        if (today := period_of(DAY, now)) != self._today:
            self._today = today
            self._forget_ended(now)  # without Redis nothing else would ever drop them
        for kind in KINDS:
            slot = (prefix, period_of(kind, now))
            self._pending[slot] = self._pending.get(slot, 0) + tokens

    def due(self) -> bool:
        return time.monotonic() - self._synced_at >= SYNC_SECONDS

    async def sync(self, pipeline: Pipeline, namespace: str, keys: Iterable[ClientKey]) -> None:
        """One round trip: the pending counts out, the budgeted keys' counters in. Raises
        what the pipeline raises (the caller marks Redis down); nothing is lost then."""
        self._synced_at = time.monotonic()
        now = self.now()
        self._forget_ended(now)
        pushed, self._pending = self._pending, {}
        for (prefix, period), tokens in pushed.items():
            name = counter_name(namespace, prefix, period)
            pipeline.incrby(name, tokens)
            pipeline.expireat(name, period.resets_at + EXPIRE_AFTER[period.kind])
        watched = [(k.prefix, period_of(kind, now)) for k in keys for kind, _ in budgets_of(k)]
        if not pushed and not watched:
            self._read = {}
            return
        if watched:
            pipeline.mget([counter_name(namespace, prefix, p) for prefix, p in watched])
        try:
            answers = await pipeline.execute()
        except BaseException:
            self._put_back(pushed)
            raise
        values = answers[-1] if watched else []
        self._read = {slot: int(v or 0) for slot, v in zip(watched, values, strict=True)}

    def _put_back(self, pushed: dict[Slot, int]) -> None:
        for slot, tokens in pushed.items():
            self._pending[slot] = self._pending.get(slot, 0) + tokens

    def _forget_ended(self, now: datetime) -> None:
        """Ended periods no request asks about any more; their pending counts are kept
        until their counters expire, so counts made while Redis was down still get there."""
        self._read = {slot: used for slot, used in self._read.items() if slot[1].resets_at > now}
        self._pending = {
            slot: tokens
            for slot, tokens in self._pending.items()
            if slot[1].resets_at + EXPIRE_AFTER[slot[1].kind] > now
        }
