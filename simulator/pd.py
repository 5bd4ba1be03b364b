"""Prefill/decode disaggregation between simulators, as vLLM 0.32's NixlConnector does it in
pull mode (shared/vllm-captures/pd-on-cpu.md; vllm/distributed/kv_transfer/kv_connector/v1/
nixl/pull_scheduler.py).

A simulator's ``role`` (:class:`simulator.config.SimConfig`) is what the connector makes of a
vLLM server:

* ``prefill`` (vLLM's ``kv_producer``): a request whose ``kv_transfer_params`` carry
  ``do_remote_decode: true`` runs as any other (its prefill time, its prefix cache hits), and
  when it finishes its answer carries a top-level ``kv_transfer_params``
  (:func:`prefill_params`): this engine's id, the request's block ids and internal id, the
  host and port to pull them from, the tokens they hold and how many of them were cache hits
  here. The blocks stay held (they count in ``vllm:kv_cache_usage_perc``) until a decode pulls
  them or the lease (``kv_lease_s``, vLLM's ``kv_lease_duration``, 30 s) ends
  (``vllm:nixl_num_kv_expired_reqs_total``, counted on the prefill, as vLLM does).
* ``decode`` (``kv_consumer``): a request whose ``kv_transfer_params`` are a valid
  :class:`RemotePrefill` (``do_remote_prefill: true`` with the block ids, engine id, request
  id, host and port) looks its prompt up in its own prefix cache, then pulls the rest from
  the prefill simulator: ``POST /sim/kv_pull`` at ``remote_host:remote_port`` (the prefill's
  own HTTP port, so no other socket is needed), which answers whether it still holds the
  blocks and lets them go. While it pulls, the request waits (``vllm:num_requests_waiting``,
  reason ``deferred``, as vLLM parks it in WAITING_FOR_REMOTE_KVS) holding its blocks, for
  ``kv_transfer_ms_per_block`` per block pulled; then it takes the head of the queue and
  produces its first token in one decode step (``itl_ms``) instead of a prefill. Those tokens
  count as ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` (and
  ``vllm:external_prefix_cache_hits_total``), the pull in ``vllm:nixl_xfer_time_seconds`` and
  ``vllm:nixl_bytes_transferred`` (``kv_bytes_per_token`` a token, whole blocks).
* ``both`` (no connector, the default): ``kv_transfer_params`` are ignored, as before.

The roles are strict: a decode never leases, a prefill never pulls; a request without
transfer parameters runs on either as on ``both`` (a prefill's answer then has no
``kv_transfer_params``, as a vLLM server without a producer connector answers).

When the pull finds nothing (the lease ended, an unknown request or engine id: the prefill
restarted, the prefill simulator is gone or does not answer), the decode computes the prompt
itself, counted as ``local_compute``, and counts a ``vllm:nixl_num_failed_transfers_total``:
vLLM's ``kv_load_failure_policy="recompute"``. Real NIXL reads the prefill's memory without
asking: blocks read after their lease ended may be garbage, which vLLM only logs on the
prefill ("Potentially invalid KV blocks ..."); the simulator does not model that risk.

Usage: a decode's ``usage.prompt_tokens_details.cached_tokens`` is the prefill's
``remote_prefill_cached_tokens`` when that is an int (vLLM >= 0.31's override), so transferred
tokens never count as cached; without it, vLLM's own count (local hits plus transferred).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

__all__ = [
    "PULL_PATH",
    "Leases",
    "RemotePrefill",
    "asks_remote_decode",
    "internal_request_id",
    "prefill_params",
    "pull_blocks",
    "remote_prefill",
    "reported_cached_tokens",
]

PULL_PATH = "/sim/kv_pull"
# A pull is one small local request; a prefill that does not answer in this long is gone.
PULL_TIMEOUT = aiohttp.ClientTimeout(total=5.0, connect=2.0)
PULL_CONNECTIONS = 256  # pulls at once from one decode, to all its prefills
_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A decode request's valid ``kv_transfer_params``: where its prompt's blocks are held."""

    host: str
    port: int
    engine_id: str
    request_id: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def asks_remote_decode(params: Any) -> bool:
    """The prefill leg's request: ``do_remote_decode`` set."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def remote_prefill(params: Any) -> RemotePrefill | None:
    """The decode leg's parameters when vLLM's pull scheduler would use them:
    ``do_remote_prefill`` set, block ids, and every remote field (else it computes locally)."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    if not params.get("remote_block_ids") or not all(f in params for f in _REMOTE_FIELDS):
        return None
    host, port = params["remote_host"], params["remote_port"]
    engine, request = params["remote_engine_id"], params["remote_request_id"]
    if not (isinstance(host, str) and _is_int(port) and isinstance(engine, str)):
        return None
    return RemotePrefill(host, port, engine, str(request)) if isinstance(request, str) else None


def reported_cached_tokens(params: Any, prompt_tokens: int) -> int | None:
    """What a decode reports as cached: the prefill's count, when the parameters ask for a
    remote prefill and carry it as an int (vLLM 0.31 took it unchecked, issue #58728; the
    simulator keeps it within the prompt, as the fix does)."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    cached = params.get("remote_prefill_cached_tokens")
    if not isinstance(cached, int) or isinstance(cached, bool):
        return None
    return min(max(cached, 0), prompt_tokens)


def internal_request_id(job_id: str, chat: bool) -> str:
    """The engine's request id, which ``remote_request_id`` carries: vLLM's external id (a
    completion's with its prompt's index) and a random suffix, "cmpl-<id>-0-1a2b3c4d"."""
    suffix = os.urandom(4).hex()
    return f"{job_id}-{suffix}" if chat else f"{job_id}-0-{suffix}"


def prefill_params(
    *,
    block_ids: list[int],
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    num_tokens: int,
    cached_tokens: int,
) -> dict[str, Any]:
    """A prefill answer's ``kv_transfer_params``, in vLLM 0.32's order and types."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [block_ids],  # one list per KV cache group
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": None,  # set only for blocks a decode keeps
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": cached_tokens,
    }


@dataclass(slots=True)
class Lease:
    blocks: int
    num_tokens: int
    timer: asyncio.TimerHandle


class Leases:
    """A prefill's finished requests whose blocks wait for a decode, by internal request id.

    `on_release(blocks, expired)` is called once per lease: when a decode takes it, or when
    its time runs out (then with ``expired``). Block ids are numbered from 1, as vLLM's (0 is
    its null block), round the cache's ``capacity``."""

    def __init__(
        self, lease_s: float, capacity: int, on_release: Callable[[int, bool], None]
    ) -> None:
        self.lease_s = lease_s
        self.capacity = max(capacity, 1)
        self._on_release = on_release
        self._held: dict[str, Lease] = {}
        self._next_block = 0

    def __len__(self) -> int:
        return len(self._held)

    def grant(self, request_id: str, num_tokens: int, block_size: int) -> list[int]:
        """Hold a finished request's blocks; returns their ids."""
        blocks = max(1, math.ceil(num_tokens / block_size))
        ids = [(self._next_block + i) % self.capacity + 1 for i in range(blocks)]
        self._next_block = (self._next_block + blocks) % self.capacity
        timer = asyncio.get_running_loop().call_later(self.lease_s, self._expire, request_id)
        self._held[request_id] = Lease(blocks, num_tokens, timer)
        return ids

    def take(self, request_id: str) -> Lease | None:
        """A decode pulls the blocks: they are released, and no one can pull them again."""
        lease = self._held.pop(request_id, None)
        if lease is not None:
            lease.timer.cancel()
            self._on_release(lease.blocks, False)
        return lease

    def _expire(self, request_id: str) -> None:
        lease = self._held.pop(request_id, None)
        if lease is not None:
            self._on_release(lease.blocks, True)

    def close(self) -> None:
        """The server stops: nothing held outlives it."""
        for lease in self._held.values():
            lease.timer.cancel()
        self._held.clear()


async def pull_blocks(
    session: aiohttp.ClientSession, remote: RemotePrefill
) -> Mapping[str, Any] | None:
    """Ask the prefill simulator for the blocks: its answer (``blocks``, ``num_tokens``) when
    it held them, None when it does not (any more), or cannot be reached."""
    host = f"[{remote.host}]" if ":" in remote.host else remote.host
    url = f"http://{host}:{remote.port}{PULL_PATH}"
    body = orjson.dumps(
        {"remote_engine_id": remote.engine_id, "remote_request_id": remote.request_id}
    )
    headers = {"Content-Type": "application/json"}
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                return None
            answer = orjson.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError):
        return None
    return answer if isinstance(answer, dict) and answer.get("held") is True else None
