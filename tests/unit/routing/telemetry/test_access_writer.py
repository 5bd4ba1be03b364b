"""The access log's batched handlers (routing.telemetry.access_writer): every line reaches
the stream, in order, off the caller's thread; flush and close drain; the file handler
follows logrotate; a forked child writes its own lines."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from routing.telemetry.access_writer import BatchedFileHandler, BatchedStreamHandler
from tests.support.servers import wait_until


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    log = logging.getLogger(f"test.access.{os.getpid()}.{id(object())}")
    log.propagate = False
    log.setLevel(logging.INFO)
    yield log
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()


def test_lines_reach_the_stream_in_order_without_a_flush(logger: logging.Logger) -> None:
    stream = io.StringIO()
    logger.addHandler(BatchedStreamHandler(stream))
    for i in range(500):
        logger.info('{"n":%d}', i)
    wait_until(lambda: stream.getvalue().count("\n") == 500, timeout=30)
    assert stream.getvalue().splitlines() == [f'{{"n":{i}}}' for i in range(500)]


def test_flush_and_close_write_what_is_buffered(logger: logging.Logger) -> None:
    stream = io.StringIO()
    handler = BatchedStreamHandler(stream)
    logger.addHandler(handler)
    logger.info("one")
    handler.flush()
    assert stream.getvalue() == "one\n"
    logger.info("two")
    logger.removeHandler(handler)
    handler.close()
    assert stream.getvalue() == "one\ntwo\n"


def test_the_file_handler_reopens_a_rotated_file(logger: logging.Logger, tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    handler = BatchedFileHandler(str(path))
    logger.addHandler(handler)
    logger.info("before")
    handler.flush()
    path.rename(tmp_path / "access.log.1")  # what logrotate does
    logger.info("after")
    handler.flush()
    assert (tmp_path / "access.log.1").read_text() == "before\n"
    assert path.read_text() == "after\n"


def test_a_forked_child_writes_its_own_lines(logger: logging.Logger, tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    handler = BatchedFileHandler(str(path))
    logger.addHandler(handler)
    logger.info("parent")
    handler.flush()
    pid = os.fork()
    if pid == 0:  # the child: its writer thread, not the parent's, writes its line
        logger.info("child")
        ok = wait_until(lambda: "child" in path.read_text(), timeout=30)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert path.read_text().splitlines() == ["parent", "child"]
