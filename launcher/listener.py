"""The one listening socket every router process inherits.

Bound once, here, before any router starts: connections that arrive while the routers are
still loading wait in its backlog, and the kernel hands each new connection to whichever
router accepts it first. A port already in use fails here, once, with a plain message.
"""

from __future__ import annotations

import socket

BACKLOG = 2048  # uvicorn's default


class ListenError(Exception):
    pass


def listener_bind(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port; IPv6 when the host is an IPv6 address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # IPv6 only, as uvicorn's own binding (asyncio's create_server) does.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock
