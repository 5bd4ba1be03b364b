"""launcher.listener: the one listening socket the routers inherit."""

from __future__ import annotations

import socket

import pytest

from launcher.listener import ListenError, listener_bind
from tests.support.servers import free_port


def test_it_listens_on_the_port_and_accepts_a_connection() -> None:
    port = free_port()
    with listener_bind("127.0.0.1", port) as sock:
        assert sock.getsockname() == ("127.0.0.1", port) and sock.family == socket.AF_INET
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        with socket.create_connection(("127.0.0.1", port), timeout=60):
            conn, _ = sock.accept()
            conn.close()


def test_port_zero_takes_a_free_one() -> None:
    with listener_bind("127.0.0.1", 0) as sock:
        assert sock.getsockname()[1] > 0


def test_an_ipv6_host_gets_an_ipv6_only_socket() -> None:
    # No skip: these machines (and CI's) bind ::1; a failure to is the launcher's to explain.
    with listener_bind("::1", 0) as sock:
        assert sock.family == socket.AF_INET6
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1


def test_a_port_in_use_fails_once_with_a_plain_message() -> None:
    with listener_bind("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}: "):
            listener_bind("127.0.0.1", port)
