"""Pushed in-flight counts (routing.peers.load_push): routers at a saturated pool agree at once.

The merge rules are checked here on a real LoadBoard, and the wait for a push's delivery
(on a real Redis where REDIS_URL names one); the behaviour end to end, with two router
processes, is tests/e2e/test_load_push.py.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import msgpack
import redis.asyncio as aioredis

from routing.fleet.load_signal import LoadBoard
from routing.peers.load_push import DELIVERY_WAIT_SECONDS, LoadPush
from routing.shared_store import SharedStore
from tests.support.common import REDIS_URL, needs_redis


def board_with(peer_counts: dict[int, int]) -> tuple[LoadPush, LoadBoard]:
    own: defaultdict[int, int] = defaultdict(int)
    board = LoadBoard(own)
    push = LoadPush("me", own, board, SharedStore("redis://127.0.0.1:1/0"), None)  # type: ignore[arg-type]
    board.others = push.merge_hash({"peer": (5, peer_counts)})
    board.refresh(time.time(), [1, 2])
    return push, board


def message(sender: str, seq: int, counts: dict[int, int]) -> bytes:
    return sender.encode() + b" " + msgpack.packb([seq, counts])


def test_a_pushed_change_moves_the_load_at_once_and_an_older_hash_does_not_undo_it() -> None:
    push, board = board_with({1: 3, 2: 1})
    assert board.loads == {1: 3, 2: 1}
    version = board.loads.version
    push.apply(message("peer", 6, {1: 2}))
    assert board.loads[1] == 2 and board.loads.version > version  # a fall re-reads indexes
    # The hash written before that message (seq 5) arrives later: the push stays.
    assert push.merge_hash({"peer": (5, {1: 3, 2: 1})}) == {1: 2, 2: 1}
    # A hash written after it (seq 6, newer counts) replaces it.
    assert push.merge_hash({"peer": (6, {2: 1})}) == {2: 1}


def test_own_stale_unknown_and_malformed_messages_change_nothing() -> None:
    push, board = board_with({1: 3})
    push.apply(message("me", 9, {1: 0}))  # its own, back from the channel
    push.apply(message("peer", 4, {1: 0}))  # older than what is known
    push.apply(message("stranger", 1, {1: 0}))  # not live in the hash yet
    assert board.loads[1] == 3 and push.received == 0
    for bad in (b"peer \xc1", message("peer", 6, [1, 2]), b"peer " + msgpack.packb([7]), b""):
        push.take(bad)  # type: ignore[arg-type]
    assert push.malformed == 4 and board.loads[1] == 3
    push.apply(message("peer", 6, {1: 2}))  # the bad seq-6 message took nothing
    assert board.loads[1] == 2


def test_a_missed_message_lets_the_next_hash_win_whatever_its_number() -> None:
    push, _ = board_with({1: 3})
    push.apply(message("peer", 8, {1: 1}))  # 6 and 7 were missed
    assert push.merge_hash({"peer": (7, {1: 2})}) == {1: 2}


def test_pushing_is_a_no_op_until_another_router_is_live() -> None:
    own: defaultdict[int, int] = defaultdict(int)
    push = LoadPush("me", own, LoadBoard(own), SharedStore("redis://127.0.0.1:1/0"), None)  # type: ignore[arg-type]
    push.changed(1)
    assert not push._dirty
    push.active = True
    push.changed(1)
    assert push._dirty == {1}


def test_delivered_returns_at_once_when_nothing_is_pending() -> None:
    push, _ = board_with({})

    async def scenario() -> float:
        start = time.perf_counter()
        push.changed(1)  # not active (no other router): nothing to tell
        await push.delivered()
        return time.perf_counter() - start

    assert asyncio.run(scenario()) < DELIVERY_WAIT_SECONDS / 2


def active_push(url: str) -> tuple[LoadPush, aioredis.Redis]:
    own: defaultdict[int, int] = defaultdict(int)
    client = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    push = LoadPush("me", own, LoadBoard(own), SharedStore(url), client)
    push.active = True
    push.set_channel("controlpanel:test-delivered:loads")
    own[1] = 1
    return push, client


@needs_redis
def test_delivered_returns_once_redis_has_taken_the_message() -> None:
    """What routing.proxy waits for before a stream's last event: the subscribers have the
    message by the time it returns."""

    async def scenario() -> tuple[int, dict[str, object] | None]:
        push, client = active_push(REDIS_URL)
        listener = aioredis.Redis.from_url(REDIS_URL).pubsub()
        await listener.subscribe(push.channel)
        await listener.get_message(timeout=1)  # the subscription's confirmation
        await push.start()
        try:
            await asyncio.sleep(0.05)  # past the sender's minimum gap
            push.changed(1)
            await push.delivered()
            sent = push.sent
            got = await listener.get_message(timeout=1)
        finally:
            await push.stop()
            await listener.aclose()
            await client.aclose()
        return sent, got

    sent, got = asyncio.run(scenario())
    assert sent == 1
    assert got is not None and msgpack.unpackb(
        got["data"].split(b" ", 1)[1], strict_map_key=False
    ) == [
        1,
        {1: 1},
    ]


def test_delivered_gives_up_when_redis_does_not_answer() -> None:
    """A Redis that accepts and never answers delays a stream's end by the cap, no more."""

    async def scenario() -> tuple[float, int]:
        silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        push, client = active_push(f"redis://127.0.0.1:{port}/0")
        await push.start()
        try:
            push.changed(1)
            start = time.perf_counter()
            await push.delivered()
            waited = time.perf_counter() - start
        finally:
            await push.stop()
            await client.aclose()
            silent.close()
        return waited, push.sent

    waited, sent = asyncio.run(scenario())
    assert sent == 0
    assert DELIVERY_WAIT_SECONDS * 0.9 <= waited < DELIVERY_WAIT_SECONDS + 0.5
