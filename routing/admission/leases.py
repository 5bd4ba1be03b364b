"""Fleet-wide admission limits: every router holds a lease on its share of each limit.

CONTROLPANEL_MAX_INFLIGHT_PER_WORKER and a model's `max_inflight` (routing.admission.admission) are
limits for the whole deployment, not for each router process. Counting the deployment's
requests on every request would cost a Redis round trip on the request path; instead each
router leases slots, off the path, and admits against its lease from memory:

* Every tick (routing.peers.fleet_sync, 50 ms), for each limit of a routable worker or a model,
  and each other one that has traffic or a lease here, the router asks one Lua script,
  atomically on Redis, for a new lease. It says how many slots it uses (`inflight`), how
  many it could use (`demand`: in flight plus queued) and how many it asks for (`ask`: the
  demand plus one spare slot, so the next request after a quiet spell need not wait for a
  tick; a router that has never sent to a worker asks too, or its first request there
  would wait a tick, and be refused at once with the queue off). The spare slot is not
  usable during the script's round trip (`hold`, below): a request arriving then waits
  those few milliseconds, and with the queue off (CONTROLPANEL_QUEUE_MAX=0) is refused.
* The script drops the leases of routers that stopped renewing them (LEASE_TTL_MS), and
  grants ``min(ask, limit - held - owed)``: ``held`` is what the other routers hold,
  ``owed`` what they are due but do not have yet (each router with demand is due up to its
  share of the limit). So the sum of the leases never exceeds the limit, an idle router's
  spare slot goes back as soon as a busy one needs it, and routers with demand converge to
  their shares: none can starve another.
* **Shares.** Among the routers with demand, each is first due its `first` slots: the
  headroom it keeps for `critical` requests (routing.admission.admission), which its standard and
  sheddable requests may not use. The rest of the limit is split by weight. A router's
  weight is the sum of the fair-share weights of the client keys with requests waiting
  there (at least 1; routing.admission.fair_queue), so the rest is split between routers as the keys
  queued behind them would split it: with keys of weights 1 and 3 each behind its own
  router, 1:3 (and the critical key beside the weight-1 key does not eat into that key's
  part); with every key behind every router, evenly, and each router's own fair queue
  splits its share 1:3. (A key spread over some routers but not others counts its weight
  at each: the split is then approximate.)
* **Whole slots.** Shares are fractional and slots are not. The routers, in order of their
  ids, lay their shares end to end on ``[0, limit)``, shifted by an offset that changes
  every EPOCH_MS (the golden-ratio sequence, so the offsets spread evenly over ``[0, 1)``;
  each limit starts the sequence elsewhere, so a router's shares of two workers' limits are
  not rounded down in the same epochs);
  a router gets the whole slots that start within its part. The shares then sum to the
  limit exactly, each is its fraction rounded down or up, and over the epochs each router's
  average is its fraction: a share of 1.375 slots is 2 slots in about 3 epochs of 8. (Before,
  shares were rounded up and the critical headroom came out of the weighted part: with a
  critical key and a weight-1 key behind one router, a weight-3 key behind the other and
  4-slot workers, the weight-1 key got 20 % of the two keys' admissions, not 25 %.)
* A grant may be below what the router runs (its share fell): those requests cannot be
  called back, so Redis records the larger of the two, which the others' grants leave
  room for, and the router admits nothing new until it runs less than its grant. (Had it
  been granted what it runs, a router with a backlog would refill every slot that frees
  and keep a lease it got first for ever: a second router's keys would never get their
  share.)
* A request the lease has no room for waits in routing.admission.admission's queue, as before; a
  grown lease wakes the queue heads.
* While the script runs, the router admits no more than it said it runs (`hold`): the
  grant may be smaller than the lease it replaces (another router gained demand), and a
  request admitted against the old lease in that round trip would put the deployment over
  the limit until the next tick. The grant is never below what was said, so nothing running
  is ever over it.
* What it "runs" includes the headroom it keeps for `critical` requests
(routing.admission.admission)
  while they are recent: the reserve's share of its lease, unused. A critical request that
  arrives during the round trip then takes a kept slot at once, instead of waiting for the
  grant; the kept slots were part of the lease the others were granted theirs against, so
  the sum of the leases still never exceeds the limit.

Without Redis, or while Redis is down, every router admits against the whole limit on its
own (the limits then hold per process, as they always did without shared state), and
/health says Redis is down.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

LEASE_TTL_MS = 2_000
SPARE_SLOTS = 1
# Fractional shares are rounded afresh each epoch, so a share of 1.4 slots is 2 slots in
# about 40 % of the epochs and 1 in the rest (module docstring).
EPOCH_MS = 1_000

# KEYS[1]: the limit's lease hash: field router id -> "grant:ms:demand", field
# "<router id>/w" -> its weight and "<router id>/f" -> the slots due to it first (fields of
# their own, so a router of the version before them, which drops any field it cannot read,
# only drops those: shares are then split by weight alone, as they were). ARGV: router id,
# limit, ask, demand, inflight, now (ms), ttl (ms), weight, first.
# Returns {grant, recorded}: what the router may run, and what Redis records for it (the
# larger of the grant and what it said it runs, which the others' grants leave room for).
LEASE_SCRIPT = """
local me, limit = ARGV[1], tonumber(ARGV[2])
local ask, demand, inflight = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local now, ttl = tonumber(ARGV[6]), tonumber(ARGV[7])
local weight = tonumber(ARGV[8] or '1') or 1
local first = tonumber(ARGV[9] or '0') or 0
local all = redis.call('HGETALL', KEYS[1])
local extra = {}
for i = 1, #all, 2 do
  local tail = string.sub(all[i], -2)
  if tail == '/w' or tail == '/f' then extra[all[i]] = tonumber(all[i + 1]) end
end
local others, due = {}, {}
if demand > 0 then due[#due + 1] = {me, weight, first} end
for i = 1, #all, 2 do
  local field = all[i]
  local tail = string.sub(field, -2)
  if field ~= me and tail ~= '/w' and tail ~= '/f' then
    local g, ts, d = string.match(all[i + 1], '^(%d+):(%d+):(%d+)$')
    if g == nil or now - tonumber(ts) > ttl then
      redis.call('HDEL', KEYS[1], field, field .. '/w', field .. '/f')
    else
      others[field] = {tonumber(g), tonumber(d)}
      if tonumber(d) > 0 then
        due[#due + 1] = {field, extra[field .. '/w'] or 1, extra[field .. '/f'] or 0}
      end
    end
  end
end
table.sort(due, function(a, b) return a[1] < b[1] end)
local firsts, weights = 0, 0
for _, r in ipairs(due) do firsts = firsts + r[3]; weights = weights + r[2] end
local scale = 1
if firsts > limit then scale = limit / firsts end
local rest = limit - firsts * scale
local spread = 0
for i = 1, #KEYS[1] do spread = (spread * 31 + string.byte(KEYS[1], i)) % 1000003 end
local offset = (math.floor(now / EPOCH_MS) * 0.6180339887498949 + spread * 0.7548776662) % 1
local shares, upto = {}, 0
for _, r in ipairs(due) do
  local before = math.floor(upto + offset + 1e-9)
  upto = upto + r[3] * scale + rest * r[2] / weights
  shares[r[1]] = math.floor(upto + offset + 1e-9) - before
end
local held, owed = 0, 0
for field, o in pairs(others) do
  held = held + o[1]
  owed = owed + math.max(0, math.min(o[2], shares[field] or 0) - o[1])
end
local grant = math.min(ask, limit - held - owed)
if grant < 0 then grant = 0 end
local recorded = grant
if recorded < inflight then recorded = inflight end
redis.call('HSET', KEYS[1], me, recorded .. ':' .. now .. ':' .. demand,
  me .. '/w', ARGV[8] or '1', me .. '/f', ARGV[9] or '0')
redis.call('PEXPIRE', KEYS[1], ttl * 10)
return {grant, recorded}
""".replace("EPOCH_MS", str(EPOCH_MS))


@dataclass(frozen=True, slots=True)
class LeaseAsk:
    key: str  # "worker:<id>" or "model:<name>"
    limit: int
    ask: int
    demand: int
    inflight: int
    # The weights of the flows waiting here for this limit, summed (at least 1): routers
    # with demand are due shares of the limit in these proportions.
    weight: float = 1.0
    # The slots due to this router before the weights split the rest: the headroom it
    # keeps for critical requests (routing.admission.admission), which its standard keys cannot use.
    first: float = 0.0


class Leases:
    """This router's leases, by limit key; `shared` while they are renewed through Redis."""

    def __init__(self) -> None:
        self.shared = False
        self.granted: dict[str, int] = {}
        # What Redis records for this router: at least what it said it runs, headroom for
        # critical requests included. Critical requests may fill it; the others, the grant.
        self.recorded: dict[str, int] = {}
        self._held_back: dict[str, tuple[int, int]] = {}  # what `hold` lowered, as it was

    def worker_cap(self, worker_id: int, limit: int, critical: bool = False) -> int:
        return self._cap(f"worker:{worker_id}", limit, critical)

    def model_cap(self, model: str, limit: int, critical: bool = False) -> int:
        return self._cap(f"model:{model}", limit, critical)

    def _cap(self, key: str, limit: int, critical: bool) -> int:
        if not self.shared:
            return limit
        grant = self.granted.get(key, 0)
        return max(grant, self.recorded.get(key, 0)) if critical else grant

    def hold(self, asks: list[LeaseAsk]) -> None:
        """The script is about to replace these leases: until its grants are in, admit no
        more than each ask says runs here (the grant is at least that)."""
        for ask in asks:
            key = ask.key
            lease, recorded = self.granted.get(key, 0), self.recorded.get(key, 0)
            if max(lease, recorded) > ask.inflight:
                self._held_back[key] = (lease, recorded)
                self.granted[key] = min(lease, ask.inflight)
                self.recorded[key] = min(recorded, ask.inflight)

    def release(self) -> None:
        """The script did not answer: Redis still holds the old leases, so they stand."""
        for key, (lease, recorded) in self._held_back.items():
            self.granted[key], self.recorded[key] = lease, recorded
        self._held_back.clear()

    def asks(
        self,
        *,
        per_worker: int,
        workers: Iterable[int] = (),
        worker_inflight: Mapping[int, int],
        worker_queued: Mapping[int, int],
        model_limits: Mapping[str, int],
        model_inflight: Mapping[str, int],
        model_queued: Mapping[str, int],
        keep: Callable[[str, int], int] = lambda key, lease: 0,
        weight: Callable[[str], float] = lambda key: 1.0,
        first: Callable[[str], float] = lambda key: 0.0,
    ) -> Iterator[LeaseAsk]:
        """What to ask for this tick: every limit of `workers` (the routable ones) and of a
        model, and any other with traffic here or a lease held. `keep(key, lease)`: slots
        of the lease to go on holding, unused, through the round trip (a priority class's
        headroom, routing.admission.admission); `weight(key)` and `first(key)`: what the router is
        due of the limit (module docstring)."""
        if per_worker:
            asked = set(workers) | set(worker_inflight) | set(worker_queued)
            for worker_id in asked | self._held("worker:"):
                running = worker_inflight.get(worker_id, 0)
                demand = running + worker_queued.get(worker_id, 0)
                key = f"worker:{worker_id}"
                held = self._keeping(key, running, keep)
                ask = max(demand, held) + SPARE_SLOTS
                yield LeaseAsk(
                    key, per_worker, ask, demand, held, _weight(weight(key)), _first(first(key))
                )
        for model, limit in model_limits.items():
            running = model_inflight.get(model, 0)
            demand = running + model_queued.get(model, 0)
            key = f"model:{model}"
            held = self._keeping(key, running, keep)
            ask = max(demand, held) + SPARE_SLOTS
            yield LeaseAsk(key, limit, ask, demand, held, _weight(weight(key)), _first(first(key)))

    def _keeping(self, key: str, running: int, keep: Callable[[str, int], int]) -> int:
        """What this router says it runs: what it does, plus the headroom it keeps, within
        its grant (the others were granted theirs knowing it, so that is safe). Not within
        the record: a record above the grant is what runs draining to a smaller share, and
        keeping headroom in it would keep that share from ever shrinking."""
        lease = self.granted.get(key, 0) if self.shared else 0
        if lease <= running:
            return running
        return min(lease, running + keep(key, lease))

    def _held(self, prefix: str) -> set[int]:
        return {
            int(k[len(prefix) :]) for k, v in self.granted.items() if v and k.startswith(prefix)
        }

    def update(self, answered: list[tuple[LeaseAsk, int, int]]) -> set[str]:
        """Record the new grants and records (a lease whose ask was not answered stands as
        it was); returns the keys whose lease grew, whose queues wake."""
        grown = set()
        for ask, grant, recorded in answered:
            # Against the lease as held: a request that came during the round trip queued
            # behind the held lease, and must wake even if the grant is the old lease again.
            key = ask.key
            if grant > self.granted.get(key, 0) or recorded > self.recorded.get(key, 0):
                grown.add(key)
            self.granted[key], self.recorded[key] = grant, recorded
            self._held_back.pop(key, None)
        self.release()
        self.shared = True
        return grown

    def fall_back(self) -> None:
        """Redis is away: admit against the whole limits locally until it is back."""
        self.release()
        self.shared = False


def _weight(value: float) -> float:
    """Within what the script writes and reads back as plain decimals."""
    return round(min(max(value, 1.0), 1e6), 3)


def _first(value: float) -> float:
    return round(min(max(value, 0.0), 1e6), 3)


def queued_per_worker(
    queued: Mapping[str, int], serving: Callable[[str], Iterator[int]]
) -> dict[int, int]:
    """Requests queued for a model count as demand on every worker serving it."""
    per_worker: defaultdict[int, int] = defaultdict(int)
    for model, count in queued.items():
        for worker_id in serving(model):
            per_worker[worker_id] += count
    return dict(per_worker)
