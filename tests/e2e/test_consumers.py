"""The dashboard websocket goes live, driven with Channels' WebsocketCommunicator: a staff
user gets the fleet, then each change, from this process or another (a simulated vLLM
worker is drained). How soon ("within a second") is a speed figure, not these tests' to time;
that a committed change nudges the publisher rather than waiting for its poll is."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import InMemoryChannelLayer, get_channel_layer
from channels.testing import WebsocketCommunicator

from controlpanel.console.live import NUDGE_GROUP, publisher
from controlpanel.fleet import services
from tests.support.servers import WAIT_CEILING_S, StartSimulator
from tests.support.websocket import communicator, session_cookie

pytestmark = pytest.mark.django_db(transaction=True)


def test_staff_gets_the_fleet_then_live_changes(simulator: StartSimulator) -> None:
    sim = simulator("m")
    worker = services.worker_add(url=sim.url, name="live-one", actor="test")
    cookie = session_cookie(staff=True)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        await publisher.start()
        comm = communicator(cookie)
        try:
            connected, _ = await comm.connect()
            assert connected
            first = json.loads(await comm.receive_from(timeout=WAIT_CEILING_S))
            drain = database_sync_to_async(services.worker_drain)
            await drain(worker_id=worker.pk, actor="test")
            # No router has anything in flight here, so the drain finishes at once.
            update = await next_update_with(comm, 'data-state="drained"')
            return first, update
        finally:
            await comm.disconnect()
            await publisher.stop()

    first, update = async_to_sync(scenario)()
    assert first["full"] is True and first["order"] == [worker.pk]
    assert "live-one" in first["rows"][str(worker.pk)]
    assert "state-drained" in update["rows"][str(worker.pk)]


async def next_update_with(comm: WebsocketCommunicator, needle: str) -> dict[str, Any]:
    while True:
        message = json.loads(await comm.receive_from(timeout=WAIT_CEILING_S))
        if any(needle in html for html in message["rows"].values()):
            return message


async def nudge_listener_joined(since: float) -> bool:
    """This process's publisher has joined the nudge group since `since` (time.time()): a
    listener of an earlier test, cancelled, stays listed, and so do other processes'."""
    layer = get_channel_layer()
    assert layer is not None
    if isinstance(layer, InMemoryChannelLayer):  # channel -> when it joined
        return any(joined >= since for joined in layer.groups.get(NUDGE_GROUP, {}).values())
    # channels_redis: a sorted set of channels scored by when they joined, each channel
    # named after its layer (one per process).
    connection = layer.connection(layer.consistent_hash(NUDGE_GROUP))
    members = await connection.zrangebyscore(layer._group_key(NUDGE_GROUP), since, "+inf")
    return any(layer.client_prefix.encode() in member for member in members)


def test_changes_from_other_processes_nudge_the_publisher(
    simulator: StartSimulator, settings: Any
) -> None:
    """With Redis, a committed change nudges the publisher over the channel layer, so the
    test gives the publisher a poll far past the wait's ceiling that only the nudge can beat;
    with the embedded in-memory layer the publisher's own 0.4 s poll is the mechanism being
    tested."""
    over_redis = bool(settings.REDIS_URL)
    sim = simulator("m")
    worker = services.worker_add(url=sim.url, name="nudged", actor="test")
    cookie = session_cookie(staff=True)
    publisher.interval = 10 * WAIT_CEILING_S if over_redis else 0.4

    async def scenario() -> None:
        since = time.time()
        await publisher.start()
        comm = communicator(cookie)
        try:
            assert (await comm.connect())[0]
            await comm.receive_from(timeout=WAIT_CEILING_S)  # the full first message
            deadline = time.monotonic() + WAIT_CEILING_S
            while not await nudge_listener_joined(since):  # or the nudge finds nobody
                assert time.monotonic() < deadline, "the nudge listener never joined"
                await asyncio.sleep(0.05)
            await database_sync_to_async(services.worker_drain)(worker_id=worker.pk, actor="t")
            await next_update_with(comm, 'data-state="drained"')
        finally:
            await comm.disconnect()
            await publisher.stop()
            publisher.interval = 0.4

    async_to_sync(scenario)()
