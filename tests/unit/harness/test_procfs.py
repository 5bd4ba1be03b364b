"""What /proc says, read for this process and a child of it: CPU times, the process tree,
the machine's ticks, memory sizes, and its sockets with their TCP ports and states."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from harness import procfs


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A child that waits on its stdin, so it ends when the test closes it."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)  # fmt: skip
    yield proc
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=60)


def test_cpu_times_and_memory_of_this_process() -> None:
    user, system = procfs.cpu_times(os.getpid())
    sum(i * i for i in range(200_000))  # some CPU time of our own
    assert user >= 0 and system >= 0
    assert sum(procfs.cpu_times(os.getpid())) >= user + system
    rss = procfs.status_kib(os.getpid(), "VmRSS")
    assert 0 < rss <= procfs.status_kib(os.getpid(), "VmHWM")
    with pytest.raises(KeyError):
        procfs.status_kib(os.getpid(), "NoSuchField")


def test_the_tree_holds_a_child_and_a_gone_process_is_just_itself(
    child: subprocess.Popen[bytes],
) -> None:
    assert child.pid in procfs.process_tree(os.getpid())
    assert procfs.process_tree(child.pid) == [child.pid]
    assert procfs.process_tree(2**22 + 12345) == [2**22 + 12345]  # no such pid: no error


def test_machine_ticks_are_busy_within_total() -> None:
    busy, total = procfs.machine_ticks()
    assert 0 <= busy <= total and total > 0


def test_a_listening_socket_is_found_with_its_port_and_state() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            fds, inodes = procfs.socket_inodes(os.getpid())
            assert fds >= len(inodes) >= 2
            table = procfs.tcp_table(os.getpid())
            mine = [table[i] for i in inodes if i in table]
            assert (port, 0, "listen") in mine
            assert (client.getsockname()[1], port, "established") in mine
