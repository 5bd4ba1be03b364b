"""The router's use of Redis: client keys' rate limits shared by every router process, and
Redis's reachability on /health.

With `REDIS_URL` set, a key's token buckets live in Redis, so N router processes together
let a key through at its limit, not N times it. One Lua script per request reads, refills
and takes from both of a key's buckets atomically, on Redis's own clock (so the routers'
clocks need not agree); it costs one round trip, and only requests made with a key that
has a limit pay it. The bucket arithmetic is routing.admission.auth's TokenBucket, written in Lua.

Redis is never allowed to stop the proxy. A call that fails or takes longer than
`timeout` falls back to this process's own buckets (routing.admission.auth: the limit then holds per
process, as without Redis) and marks the store down; /health says "degraded" with the
error, and the refresher's periodic ping brings it back by itself once Redis answers
again. While it is down no request waits for Redis: only the ping tries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger(__name__)

KEY_PREFIX = "controlpanel:ratelimit:"
PING_EVERY_SECONDS = 2.0

# KEYS: the tokens bucket, the requests bucket. ARGV: tpm, rpm (0: no such limit), then the
# mode: "admit" (tokens must be above zero, then one request is taken) or "charge" (ARGV[4]
# tokens are taken, even past zero). Returns {which limit refused or "", seconds to wait}.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function refill(key, per_minute)
  local rate = per_minute / 60
  local v = redis.call('HMGET', key, 'level', 'ts')
  local level = tonumber(v[1]) or per_minute
  local ts = tonumber(v[2]) or now
  return math.min(per_minute, level + math.max(0, now - ts) * rate), rate
end
local function store(key, per_minute, level)
  redis.call('HSET', key, 'level', tostring(level), 'ts', tostring(now))
  redis.call('EXPIRE', key, 120)
end
local tpm, rpm = tonumber(ARGV[1]), tonumber(ARGV[2])
if ARGV[3] == 'charge' then
  local level = refill(KEYS[1], tpm)
  store(KEYS[1], tpm, level - tonumber(ARGV[4]))
  return {'', '0'}
end
if tpm > 0 then
  local level, rate = refill(KEYS[1], tpm)
  store(KEYS[1], tpm, level)
  if level <= 0 then return {'tpm', tostring((1 - level) / rate)} end
end
if rpm > 0 then
  local level, rate = refill(KEYS[2], rpm)
  if level < 1 then
    store(KEYS[2], rpm, level)
    return {'rpm', tostring((1 - level) / rate)}
  end
  store(KEYS[2], rpm, level - 1)
end
return {'', '0'}
"""


@cache
def redis_errors() -> tuple[type[Exception], ...]:
    """What a failed call to Redis raises: RedisError, OSError, TimeoutError.

    A function, for ``except redis_errors():`` (evaluated only when an exception is being
    matched): redis and its parsers cost a process ~9 MiB, and a router without REDIS_URL
    never imports them. Only Redis's users call it, on their failure paths.
    """
    from redis.exceptions import RedisError

    return (RedisError, OSError, TimeoutError)


def redis_client(url: str, timeout: float, **options: Any) -> aioredis.Redis:
    """A Redis connection pool (redis imported here: see redis_errors)."""
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, **options
    )


class SharedStore:
    """One Redis connection pool for the router process; `error` is None while Redis works."""

    def __init__(self, url: str, *, timeout: float = 0.25) -> None:
        self.url = url
        self.error: str | None = None
        self._client = redis_client(url, timeout, max_connections=64, health_check_interval=30)
        self._script = self._client.register_script(_SCRIPT)
        self._next_ping = 0.0
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def up(self) -> bool:
        return self.error is None

    @property
    def client(self) -> aioredis.Redis:
        """The process's one connection pool, for routing.peers.fleet_sync too."""
        return self._client

    def mark_down(self, exc: BaseException) -> None:
        """Another user of the pool saw Redis fail: every shared thing falls back now."""
        self._down(exc)

    async def admit(self, key_prefix: str, tpm: int | None, rpm: int | None) -> tuple[str, float]:
        """("tpm" | "rpm", seconds to wait) when a shared bucket refuses, ("", 0) when both
        let the request in. Raises RedisUnavailable when Redis cannot answer."""
        result = await self._call(key_prefix, tpm, rpm, "admit", 0)
        which, wait = result
        return (which.decode() if isinstance(which, bytes) else str(which)), float(wait)

    def charge(self, key_prefix: str, tpm: int, tokens: int) -> None:
        """Take `tokens` from the key's shared tokens bucket, in the background: the answer
        has been sent already and nobody should wait for this."""
        task = asyncio.get_running_loop().create_task(self._charge(key_prefix, tpm, tokens))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _charge(self, key_prefix: str, tpm: int, tokens: int) -> None:
        # A failure is recorded in `error` already; the local bucket was charged too.
        with contextlib.suppress(RedisUnavailable):
            await self._call(key_prefix, tpm, None, "charge", tokens)

    async def _call(
        self, key_prefix: str, tpm: int | None, rpm: int | None, mode: str, tokens: int
    ) -> list[Any]:
        if self.error is not None:
            raise RedisUnavailable(self.error)
        # By the key's public prefix, not its database id: ids start again at 1 in a new
        # database (a test run, a re-install) sharing the same Redis.
        name = KEY_PREFIX + key_prefix
        keys = [f"{name}:tpm:{tpm or 0}", f"{name}:rpm:{rpm or 0}"]
        try:
            args: list[str | int] = [tpm or 0, rpm or 0, mode, tokens]
            result: list[Any] = await self._script(keys=keys, args=args)
        except redis_errors() as exc:
            self._down(exc)
            raise RedisUnavailable(self.error) from exc
        return result

    async def ping_if_due(self) -> None:
        """Called by the refresher every poll: at most every PING_EVERY_SECONDS, ask Redis
        whether it is there, which is how a store marked down comes back."""
        now = time.monotonic()
        if now < self._next_ping:
            return
        self._next_ping = now + PING_EVERY_SECONDS
        try:
            await self._client.ping()
        except redis_errors() as exc:
            self._down(exc)
            return
        if self.error is not None:
            log.warning("Redis is reachable again; rate limits and routing state are shared")
        self.error = None

    def _down(self, exc: BaseException) -> None:
        if self.error is None:
            log.error(
                "Redis unavailable (%s); rate limits and routing state fall back to this process",
                exc,
            )
        self.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await self._client.aclose()


class RedisUnavailable(Exception):
    """The shared store could not answer; the caller falls back to per-process state."""
