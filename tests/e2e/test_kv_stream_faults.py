"""KV cache events end to end when the stream goes wrong: a lost connection to the same
engine, a malformed batch, a gap in the sequence (replayed from the engine's replay socket,
or not), an unreachable endpoint and a socket that cannot be made. The router keeps
subscribing, and a worker's index is unknown, never wrong, until it is whole again.

"Exact" is checked against the simulator's own prefix cache, as in tests/e2e/test_kv_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq.asyncio

from controlpanel.fleet import services
from routing.kv.kv_index import KvIndex
from routing.kv.kv_stream import KvStream
from tests.support.kv_events import (
    BS,
    MODEL,
    add_kv_worker,
    clear_cache,
    complete,
    endpoints,
    index_of,
    kv_config,
    on_sim_loop,
    prompt,
    stream,
    wait_ready,
    wait_same_blocks,
    wait_stream,
)
from tests.support.servers import (
    RouterServer,
    SimulatorLoop,
    StartSimulator,
    free_port,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)


class TcpProxy:
    """A TCP relay in front of a simulator's PUB socket; cut() drops every connection, as
    a network blip would, while the engine behind it keeps running."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()

    async def stop(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


def test_a_lost_connection_resumes_when_the_engine_is_the_same(
    router: RouterServer, simulator: StartSimulator, sim_loop: SimulatorLoop
) -> None:
    # The engine keeps only 3 batches for replay, so a rebuild from its first batch could
    # not succeed: after the blip the router must recognise the engine and replay only
    # what it missed.
    sim = simulator(MODEL, **kv_config(kv_events_buffer=3, cache_blocks=64))
    proxy = TcpProxy(sim.state.config.kv_events_port)
    sim_loop.run(proxy.start())
    try:
        kv = {**endpoints(sim), "kv_events": f"tcp://127.0.0.1:{proxy.port}"}
        worker = services.worker_add(url=sim.url, name="kv-blip", actor="test", **kv)
        router.wait_routable(worker)
        wait_ready(router, worker)
        for tag in "abcde":
            complete(router, prompt(tag))
        wait_same_blocks(router, worker, sim)
        on_sim_loop(sim_loop, proxy.cut)
        wait_stream(router, worker, at_least_disconnects=1)
        complete(router, prompt("f"))  # published while the router may be away
        wait_stream(router, worker, connected=True, index_trust="ready")
        wait_same_blocks(router, worker, sim)
        replays = stream(router, worker)["replays"]
        assert replays.get("resumed", 0) >= 1 and "incomplete" not in replays, replays
        assert index_of(router, worker)["blocks"] == 6 * 3
    finally:
        sim_loop.run(proxy.stop())


def test_a_malformed_batch_is_counted_and_the_worker_unknown_until_cleared(
    router: RouterServer, simulator: StartSimulator, sim_loop: SimulatorLoop
) -> None:
    sim = simulator(MODEL, **kv_config())
    worker = add_kv_worker(router, sim, "kv-bad")
    wait_ready(router, worker)
    complete(router, prompt("a"))
    wait_same_blocks(router, worker, sim)
    publisher = sim.state.kv_events
    assert publisher is not None
    on_sim_loop(sim_loop, lambda: publisher.send_raw(publisher.next_seq(), b"\xc1 not msgpack"))
    wait_stream(router, worker, malformed=1)
    assert index_of(router, worker)["trust"] == "unknown"  # its events are lost
    assert router.get("/health").status_code == 200
    complete(router, prompt("b"))  # the router and the stream carry on
    assert "malformed KV event batch" in router.log()
    # vLLM's /reset_prefix_cache sends AllBlocksCleared: known empty, trusted again.
    assert clear_cache(sim)
    wait_same_blocks(router, worker, sim)
    assert 'controlpanel_router_kv_events_malformed_total{worker="kv-bad"} 1.0' in (
        router.get("/metrics").text
    )


def test_a_gap_is_replayed_from_the_replay_socket(
    router: RouterServer, simulator: StartSimulator, sim_loop: SimulatorLoop
) -> None:
    sim = simulator(MODEL, **kv_config())
    worker = add_kv_worker(router, sim, "kv-gap")
    wait_ready(router, worker)
    publisher = sim.state.kv_events
    assert publisher is not None
    gaps = stream(router, worker)["gaps"]
    on_sim_loop(sim_loop, lambda: publisher.lose_next(1))
    complete(router, prompt("a"))  # batch 0: buffered, never sent
    complete(router, prompt("b"))  # batch 1: shows the gap
    wait_stream(router, worker, gaps=gaps + 1)
    wait_same_blocks(router, worker, sim)
    shown = stream(router, worker)
    assert shown["replays"].get("complete", 0) >= 1 and shown["last_seq"] == 1


def test_a_gap_without_replay_is_unknown_until_cleared(
    router: RouterServer, simulator: StartSimulator, sim_loop: SimulatorLoop
) -> None:
    sim = simulator(MODEL, **kv_config(replay=False))
    worker = add_kv_worker(router, sim, "kv-noreplay")
    wait_stream(router, worker, connected=True)
    # Known from the first batch the router receives: a fresh engine's batch 0 or, should the
    # subscription still be on its way when that one goes out, a reset's AllBlocksCleared.
    wait_until(lambda: clear_cache(sim) and index_of(router, worker).get("trust") == "ready")
    complete(router, prompt("a"))
    wait_same_blocks(router, worker, sim)
    publisher = sim.state.kv_events
    assert publisher is not None
    gaps = stream(router, worker)["gaps"]
    on_sim_loop(sim_loop, lambda: publisher.lose_next(1))
    complete(router, prompt("b"))
    complete(router, prompt("c"))
    wait_stream(router, worker, gaps=gaps + 1)
    assert index_of(router, worker)["trust"] == "unknown"
    assert 'controlpanel_router_kv_index_trusted{worker="kv-noreplay"} 0.0' in (
        router.get("/metrics").text
    )
    assert clear_cache(sim)
    wait_same_blocks(router, worker, sim)


def test_an_unreachable_endpoint_is_retried_with_backoff(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator(MODEL)
    port = free_port()  # nothing listens there yet
    worker = services.worker_add(
        url=sim.url, name="kv-late", kv_events=f"tcp://127.0.0.1:{port}", actor="test"
    )
    # ZeroMQ retries from 100 ms, doubling: the third retry waits at least 400 ms.
    wait_stream(router, worker, at_least_connect_retries=3, at_least_retry_interval_ms=400)
    shown = stream(router, worker)
    assert not shown["connected"] and shown["index"] is None
    assert 'controlpanel_router_kv_events_connected{worker="kv-late"} 0.0' in (
        router.get("/metrics").text
    )
    late = simulator(MODEL, kv_events_port=port, block_size=BS)  # the publisher appears
    wait_until(lambda: stream(router, worker).get("connected"))
    assert late.state.kv_events is not None


def test_a_socket_that_cannot_be_made_is_retried_not_fatal(sim_loop: SimulatorLoop) -> None:
    # The API refuses such endpoints; one written straight to the database still only makes
    # that stream retry (with doubling pauses) and say why.
    index = KvIndex()
    ctx = zmq.asyncio.Context()
    stream = on_sim_loop(sim_loop, lambda: KvStream(ctx, index, 1, "bogus://nowhere"))
    on_sim_loop(sim_loop, stream.start)
    try:
        wait_until(lambda: stream.stats.errors >= 3)
        assert "Protocol not supported" in (stream.stats.last_error or "")
        assert not stream.stats.connected and index.cached_blocks(1, [1, 2, 3, 4]) is None
    finally:
        sim_loop.run(stream.stop())
        ctx.destroy(linger=0)
