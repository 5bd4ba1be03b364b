"""One router child: uvicorn serving `controlpanel.asgi:application` on the listening socket
the supervisor bound and passed down (`python -m launcher.router --fd N --grace S`).

The same server as `python -m uvicorn controlpanel.asgi:application --lifespan on
--no-access-log --timeout-graceful-shutdown S`, with one difference that matters: uvicorn's
own `--fd` wraps the descriptor as a Unix socket, so the TCP connections it accepts never get
TCP_NODELAY and small streamed chunks can wait on Nagle's algorithm. Here the socket's family
is read from the descriptor, and uvicorn serves it as it would a socket it had bound itself.

This module runs only in a router child, never in the supervisor; it is the one place in
`launcher` that imports anything beyond the standard library (uvicorn).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from types import FrameType

import uvicorn

APP = "controlpanel.asgi:application"
STARTUP_FAILURE = 3  # uvicorn's exit code when the application does not start
# uvicorn's own lines in the format of every other process's (settings.LOG_FORMAT), so the
# console has one timestamp style; there is no access log of uvicorn's (the router's own).
LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {
            # Named "uvicorn", not its logger's misleading "uvicorn.error".
            "format": "%(asctime)s %(levelname)s uvicorn: %(message)s",
            "datefmt": "%Y-%m-%d %H:%M:%S %Z",
        }
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
    },
    "loggers": {
        "uvicorn": {"handlers": ["console"], "level": "INFO", "propagate": False},
    },
}


class Server(uvicorn.Server):
    """uvicorn's server, ticking once a second rather than ten times.

    uvicorn's main loop wakes every 0.1 s only to notice a signal and, every tenth time, to
    renew the Date header. Here it renews the header at each of its once-a-second ticks, and
    a signal wakes it at once, so an idle router's event loop sleeps nine wake-ups a second
    longer (issue #29: idle costs nothing) and stops as promptly as before.
    """

    _woken: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop, self._woken = asyncio.get_running_loop(), asyncio.Event()
        should_exit = await self.on_tick(0)
        while not should_exit:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), 1.0)
            should_exit = await self.on_tick(0)  # 0: a tick that renews the Date header

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._woken is not None:
            self._loop.call_soon_threadsafe(self._woken.set)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.router")
    parser.add_argument("--fd", type=int, required=True, help="the inherited listening socket")
    parser.add_argument("--grace", type=int, default=30, metavar="SECONDS")
    args = parser.parse_args()
    sock = socket.socket(fileno=args.fd)  # family, type and protocol read from the descriptor
    config = uvicorn.Config(
        APP,
        lifespan="on",
        access_log=False,
        timeout_graceful_shutdown=args.grace,
        log_config=LOG_CONFIG,
    )
    server = Server(config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if sock.family == socket.AF_INET6 else host
    number = int(os.environ.get("CONTROLPANEL_ROUTER_INDEX", "0")) + 1
    count = os.environ.get("CONTROLPANEL_ROUTERS", "1")
    logging.getLogger("uvicorn.error").info(
        "Router %d of %s (pid %d) serving http://%s:%d", number, count, os.getpid(), shown, port
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])  # re-raises SIGINT or SIGTERM once it has shut down
    return 0 if server.started else STARTUP_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())
