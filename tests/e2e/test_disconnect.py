"""A client that goes away cancels the upstream request at once (vLLM frees its KV cache)."""

from __future__ import annotations

import socket

import orjson
import pytest

from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def raw_post(router: RouterServer, path: str, body: dict[str, object]) -> socket.socket:
    """A bare socket, so the test decides exactly when the client vanishes."""
    host, port = router.url.removeprefix("http://").split(":")
    payload = orjson.dumps(body)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def test_disconnect_mid_stream_cancels_upstream(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m", itl_ms=50)
    worker = add_worker(sim)
    sock = raw_post(
        router, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 400, "stream": True}
    )
    received = b""
    while b"data: " not in received:
        received += sock.recv(65536)
    assert received.startswith(b"HTTP/1.1 200 OK")
    assert router.workers()[worker.pk]["inflight"] == 1
    sock.close()
    wait_until(lambda: sim.state.cancelled == 1)
    assert sim.state.running == 0 and sim.state.completed == 0
    router.wait_for(lambda seen: seen[worker.pk]["inflight"] == 0)


def test_disconnect_while_waiting_for_a_non_streamed_answer(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m", itl_ms=50)
    worker = add_worker(sim)
    sock = raw_post(
        router,
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 400},
    )
    wait_until(lambda: sim.state.running == 1)
    sock.close()
    wait_until(lambda: sim.state.cancelled == 1)
    router.wait_for(lambda seen: seen[worker.pk]["inflight"] == 0)
