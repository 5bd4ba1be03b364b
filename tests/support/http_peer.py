"""A tiny HTTP server in this process standing in for a worker (or its exporter) in unit
tests: a thread on a free port answering each path with what the test set, and keeping the
requests' paths and headers (and POSTs' JSON bodies). Paths not set answer 404, as an older
vLLM does."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Answer:
    status: int = 200
    body: Any = None  # JSON-encoded unless bytes or str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class HttpPeer:
    url: str
    answers: dict[str, Answer]
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    posted: list[tuple[str, Any]] = field(default_factory=list)  # (path, JSON body)

    def answer(self, path: str, body: Any = None, status: int = 200, **headers: str) -> None:
        self.answers[path] = Answer(
            status, body, {k.replace("_", "-"): v for k, v in headers.items()}
        )

    def models(self, *ids: str, **extra: Any) -> None:
        """/v1/models as vLLM answers it, one entry per id."""
        data = [{"id": i, "object": "model", "root": i, "parent": None, **extra} for i in ids]
        self.answer("/v1/models", {"object": "list", "data": data})


@contextmanager
def http_peer() -> Iterator[HttpPeer]:
    answers: dict[str, Answer] = {}
    seen: list[tuple[str, dict[str, str]]] = []
    posted: list[tuple[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            posted.append((self.path, json.loads(raw) if raw else None))
            self.do_GET()

        def do_GET(self) -> None:
            seen.append((self.path, dict(self.headers)))
            answer = answers.get(self.path.split("?", 1)[0], Answer(404, {"detail": "Not Found"}))
            body = answer.body
            if not isinstance(body, bytes):
                body = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(answer.status)
            for name, value in answer.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield HttpPeer(f"http://127.0.0.1:{server.server_address[1]}", answers, seen, posted)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
