"""A recording TCP forwarder between the router and a worker: what the worker really sent.

Comparing the router's answer with a second request sent straight to a real vLLM server
needs vLLM to generate the same tokens twice, which a tiny random-weight model does not
promise (near ties at temperature 0 break differently from run to run on a loaded CPU). The
tap records the bytes of each connection in both directions instead, so a test compares what
the client got with the very answer the worker gave to that request.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import h11

from tests.support.servers import free_port


@dataclass
class Connection:
    sent: bytearray = field(default_factory=bytearray)  # router -> worker
    answered: bytearray = field(default_factory=bytearray)  # worker -> router


@dataclass
class Tap:
    url: str
    connections: list[Connection]

    def answers_to(self, request_line: bytes) -> list[tuple[int, bytes]]:
        """The status and body (transfer-decoded) of every answer to a request that starts
        with `request_line` (e.g. b"POST /v1/messages"), in the order of connections."""
        return [a for c in self.connections for a in _answers(c, request_line)]


def _answers(conn: Connection, request_line: bytes) -> list[tuple[int, bytes]]:
    """Replay one connection through h11, request by request (keep-alive may carry several)."""
    requests, answers = h11.Connection(h11.SERVER), h11.Connection(h11.CLIENT)
    requests.receive_data(bytes(conn.sent))
    answers.receive_data(bytes(conn.answered))
    found = []
    while (request := _next_request(requests)) is not None:
        # h11 reads an answer only after "sending" its request: the line, without a body.
        answers.send(h11.Request(method=request.method, target=request.target,
                                 headers=[("host", "tap")]))  # fmt: skip
        answers.send(h11.EndOfMessage())
        status, body = _next_answer(answers)
        if request.method + b" " + request.target == request_line:
            found.append((status, body))
        answers.start_next_cycle()
        requests.send(h11.Response(status_code=status, headers=[("content-length", "0")]))
        requests.send(h11.EndOfMessage())
        requests.start_next_cycle()
    return found


def _next_request(requests: h11.Connection) -> h11.Request | None:
    request = requests.next_event()
    if not isinstance(request, h11.Request):  # NEED_DATA: the connection's last request
        return None
    while not isinstance(requests.next_event(), h11.EndOfMessage):
        pass  # its body
    return request


def _next_answer(answers: h11.Connection) -> tuple[int, bytes]:
    status, body = 0, bytearray()
    while not isinstance(event := answers.next_event(), h11.EndOfMessage):
        assert event is not h11.NEED_DATA, "the worker's answer was cut off"
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
    return status, bytes(body)


@contextmanager
def tap(host: str, port: int) -> Iterator[Tap]:
    """A tap on 127.0.0.1 forwarding to host:port, run on its own thread and event loop."""
    listen = free_port()
    recorded = Tap(url=f"http://127.0.0.1:{listen}", connections=[])
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, into: bytearray
    ) -> None:
        while data := await reader.read(65536):
            into += data
            writer.write(data)
            await writer.drain()
        writer.close()

    handlers: set[asyncio.Task[None]] = set()
    done: asyncio.Future[None] = loop.create_future()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        conn = Connection()
        recorded.connections.append(conn)
        upstream_r, upstream_w = await asyncio.open_connection(host, port)
        await asyncio.gather(
            pipe(client_r, upstream_w, conn.sent),
            pipe(upstream_r, client_w, conn.answered),
            return_exceptions=True,
        )

    def track(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(handle(client_r, client_w))
        handlers.add(task)
        task.add_done_callback(handlers.discard)

    async def serve() -> None:
        server = await asyncio.start_server(track, "127.0.0.1", listen)
        ready.set()
        async with server:
            await done
        for task in list(handlers):  # connections the router keeps alive
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield recorded
    finally:
        loop.call_soon_threadsafe(done.set_result, None)
        thread.join(10)
        loop.close()
