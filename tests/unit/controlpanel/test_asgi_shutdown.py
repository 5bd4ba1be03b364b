"""The lifespan's shutdown steps are bounded (controlpanel.asgi.stop_within): one stuck on the
database or Redis is logged by name and left behind, so the router still completes its
shutdown before the supervisor's margin runs out."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from controlpanel import asgi


async def _stuck() -> None:
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.Event().wait()  # even its cancel hangs, as a stuck close would


async def _fails() -> None:
    raise RuntimeError("store gone")


def test_a_stuck_step_is_left_behind_by_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(asgi, "STOP_STEP_SECONDS", 0.2)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="controlpanel.asgi"):
        # asyncio.run then cancels the task left behind once more, which ends it.
        asyncio.run(asgi.stop_within("the router", _stuck()))
    assert time.monotonic() - started < 2.0
    assert "the router did not stop within" in caplog.text


def test_a_failing_step_is_logged_and_a_quick_one_is_silent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="controlpanel.asgi"):
        asyncio.run(asgi.stop_within("the snapshot refresher", _fails()))
        asyncio.run(asgi.stop_within("the router", asyncio.sleep(0)))
    assert "the snapshot refresher failed to stop cleanly" in caplog.text
    assert "the router" not in caplog.text
