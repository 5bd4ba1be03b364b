"""Bad input through a raw socket: each case gets a clear 4xx in the OpenAI error shape,
and the server keeps serving everyone else meanwhile."""

from __future__ import annotations

import json
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from simulator.server import RunningSimulator
from tests.support.servers import AddWorker, RouterServer, StartSimulator

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def served(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> Iterator[RunningSimulator]:
    sim = simulator("m")
    add_worker(sim)
    yield sim


def connect(router: RouterServer) -> socket.socket:
    host, port = router.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def request(path: str, body: bytes, *, headers: str = "", length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{headers}\r\n"
    )
    return head.encode() + body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response off the connection, leaving any pipelined ones after it unread."""
    reader = _readers.get(sock)
    if reader is None:
        reader = _readers[sock] = sock.makefile("rb")
    status = int(reader.readline().split()[1])
    headers: dict[str, str] = {}
    while (line := reader.readline().decode("latin-1").strip()) != "":
        name, _, value = line.partition(":")
        headers[name.lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, reader.read(int(headers["content-length"]))
    body = b""
    while (size := int(reader.readline().strip(), 16)) > 0:  # chunked
        body += reader.read(size)
        reader.readline()
    reader.readline()
    return status, headers, body


_readers: weakref.WeakKeyDictionary[socket.socket, Any] = weakref.WeakKeyDictionary()


def assert_openai_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> str:
    assert status == expected, body
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] == expected and error["message"]
    return str(error["message"])


def still_serving(router: RouterServer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 1}
    assert router.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    "body, words",
    [
        (b'{"model": "m", "messages": [', "not valid JSON"),
        (b'{"model": 42, "messages": []}', "`model`"),
        (b'{"model": ["m"], "messages": []}', "`model`"),
        (b'{"model": null}', "`model`"),
        (b'"just a string"', "`model`"),
        (b'{"model": "m\xff\xfe", "messages": []}', "not valid JSON"),
        (b"\x00\x01\x02", "not valid JSON"),
    ],
)
def test_malformed_bodies(
    router: RouterServer, served: RunningSimulator, body: bytes, words: str
) -> None:
    with connect(router) as sock:
        sock.sendall(request("/v1/chat/completions", body))
        message = assert_openai_error(*read_response(sock), 400)
    assert words in message
    still_serving(router)


def test_huge_body_is_refused_before_it_is_read(
    router: RouterServer, served: RunningSimulator
) -> None:
    with connect(router) as sock:
        sock.sendall(request("/v1/chat/completions", b"", length=10 * 1024 * 1024 * 1024))
        assert_openai_error(*read_response(sock), 413)
    still_serving(router)


def test_huge_headers(router: RouterServer, served: RunningSimulator) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}'
    header = "X-Padding: " + "a" * 200_000 + "\r\n"
    with connect(router) as sock:
        sock.sendall(request("/v1/chat/completions", body, headers=header))
        assert_openai_error(*read_response(sock), 431)
    still_serving(router)


def test_unknown_paths_and_methods(router: RouterServer, served: RunningSimulator) -> None:
    for method, path, status in [
        ("POST", "/v1/nope", 404),
        ("GET", "/v1/chat/completions", 405),
        ("POST", "/sleep", 404),
        ("POST", "/v1/models", 405),
    ]:
        response = httpx.request(method, router.url + path, json={"model": "m"}, timeout=10)
        assert response.status_code == status
        assert response.json()["error"]["code"] == status
    still_serving(router)


def test_slowloris_is_cut_off_and_others_are_served(
    router: RouterServer, served: RunningSimulator
) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "slow"}]}'
    sent: list[int] = []
    with connect(router) as sock:
        sock.sendall(request("/v1/chat/completions", b"", length=len(body)))
        trickle = threading.Thread(target=_trickle, args=(sock, body, sent))
        trickle.start()
        still_serving(router)  # served meanwhile
        status, headers, answer = read_response(sock)
        sent_when_cut = len(sent)
        sock.shutdown(socket.SHUT_RDWR)
    trickle.join()
    assert_openai_error(status, headers, answer, 408)
    # Cut off by the body timeout (2 s in the test settings), not answered once the whole
    # body was in: the trickle (13 s) was still going.
    assert sent_when_cut < len(body), sent_when_cut


def _trickle(sock: socket.socket, body: bytes, sent: list[int]) -> None:
    """The slow client of the scenario: a byte every 0.2 s (the pace is the point)."""
    for byte in body:
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return
        sent.append(byte)
        time.sleep(0.2)


def test_pipelined_requests_are_answered_in_order(
    router: RouterServer, served: RunningSimulator
) -> None:
    first = b'{"model": "m", "messages": [{"role": "user", "content": "1"}], "max_tokens": 1}'
    broken = b'{"model": 7}'
    with connect(router) as sock:
        sock.sendall(
            request("/v1/chat/completions", first)
            + request("/v1/chat/completions", broken)
            + request("/v1/chat/completions", first)
        )
        statuses = [read_response(sock)[0] for _ in range(3)]
    assert statuses == [200, 400, 200]
