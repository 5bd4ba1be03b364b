"""The access log's handlers: its lines leave the request path and reach the stream in
batches.

A request's line is formatted on the path (orjson already made it) and appended to a
buffer; one writer thread per handler wakes when the buffer stops being empty, lets lines
gather for up to GATHER_SECONDS, and writes them with one write and one flush. Logging's own
handlers write and flush once per line, a system call or two on every request
(bench/RESULTS.md, the profile). The thread sleeps while no request comes, so an idle router
pays nothing. `flush()` and `close()` (logging's shutdown at exit) write what is buffered
first, so a router that stops on SIGTERM loses no line; one killed outright loses at most
GATHER_SECONDS of them.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import threading
from typing import Any

GATHER_SECONDS = 0.05


class BatchedHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler whose emit only buffers (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._start()
        # A forked child (Celery's pool) has the buffer but not the thread: it gets its own.
        os.register_at_fork(after_in_child=self._start)

    def _start(self) -> None:
        self._lines: list[str] = []
        self._ready = threading.Condition(threading.Lock())
        self._closing = False
        self._writer = threading.Thread(target=self._run, name="access-log", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except (TypeError, ValueError):  # logging's rule: a bad record never breaks the caller
            self.handleError(record)
            return
        self.add_line(line)

    def add_line(self, line: str) -> None:
        """A finished line into the buffer: what emit does after formatting, and what the
        access log calls directly when logging would only have passed its line through
        (routing.telemetry.access_log.direct_handler)."""
        with self._ready:
            self._lines.append(line)
            if len(self._lines) == 1:
                self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._lines and not self._closing:
                    self._ready.wait()
                if self._closing and not self._lines:
                    return
            self._ready_wait(GATHER_SECONDS)
            self._drain()

    def _ready_wait(self, seconds: float) -> None:
        with self._ready:
            if not self._closing:
                self._ready.wait_for(lambda: self._closing, timeout=seconds)

    def _drain(self) -> None:
        with self._ready:
            lines, self._lines = self._lines, []
        if not lines:
            return
        self.acquire()
        try:
            self._write_lines(lines)
        except (OSError, ValueError):  # a full disk or a closed stream: said once per batch
            self.handleError(logging.makeLogRecord({"msg": f"{len(lines)} access log lines"}))
        finally:
            self.release()

    def _write_lines(self, lines: list[str]) -> None:
        self.stream.write(self.terminator.join(lines) + self.terminator)
        self.stream.flush()

    def flush(self) -> None:
        if hasattr(self, "_ready"):
            self._drain()
        super().flush()

    def close(self) -> None:
        with self._ready:
            self._closing = True
            self._ready.notify_all()
        if self._writer.is_alive() and self._writer is not threading.current_thread():
            self._writer.join(timeout=5)
        self._drain()
        super().close()


class BatchedStreamHandler(BatchedHandler):
    """The access log on stderr (the default)."""


class BatchedFileHandler(BatchedHandler, logging.handlers.WatchedFileHandler):
    """The access log in CONTROLPANEL_ACCESS_LOG_FILE, reopened when logrotate moves it."""

    def _write_lines(self, lines: list[str]) -> None:
        self.reopenIfNeeded()
        if self.stream is None:
            self.stream = self._open()
        super()._write_lines(lines)
