"""Child processes: start one (in a session of its own, logging to a file, SIGTERMed should its
parent die), wait for it to answer, and stop a set of them: SIGTERM, a shared deadline, then
SIGKILL, and for a process group whatever its leader left behind.

The standard library only: ``launcher.supervisor`` (which loads nothing heavy) uses it, as do
the benchmarks (:mod:`harness.fleet`) and the real vLLM servers (:mod:`harness.real_vllm`).

* :func:`spawn` starts a :class:`Running` child. ``group=True`` makes it the leader of a
  session of its own and signals the whole group (a real vLLM server's engine runs in a
  process of its own that would otherwise outlive it, holding gigabytes); ``new_session``
  alone only keeps a Ctrl-C in the terminal from reaching it. ``die_with_parent`` asks the
  kernel to SIGTERM it should this process die, even by SIGKILL.
* :func:`stop` ends children: SIGTERM to all, then each waited for until one deadline, then
  SIGKILL; a group is then SIGKILLed whole and waited for until no member runs.
* Readiness: :func:`http_answers` (one ``GET`` answered 200), :func:`wait_until` (poll a
  predicate until true or a ceiling), :func:`free_port` / :func:`free_ports`.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

PR_SET_PDEATHSIG = 1  # linux/prctl.h
GROUP_GONE_SECONDS = 5.0  # how long the killed rest of a group is waited for
LOG_TAIL_BYTES = 64 * 1024  # vLLM's logs grow long: only their end is read
HOST = "127.0.0.1"

T = TypeVar("T")


@dataclass
class Running:
    """A started child: its name (for messages), its process, whether it is signalled as a
    process group, its log file if it has one, and its command (to start it again)."""

    name: str
    proc: subprocess.Popen[bytes]
    group: bool = False
    log: Path | None = None
    command: tuple[str, ...] = ()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        return log_tail(self.log, lines) if self.log else "(no log)"


def spawn(
    name: str,
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    log: Path | None = None,
    append: bool = True,
    group: bool = False,
    new_session: bool = False,
    die_with_parent: bool = False,
    pass_fds: Sequence[int] = (),
    stdin: int | None = None,
) -> Running:
    """Start `command`; with `log`, its stdout and stderr go there (appended unless `append`
    is False), else they are this process's."""
    handle = log.open("ab" if append else "wb") if log else None
    try:
        proc = subprocess.Popen(
            list(command),
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=stdin,
            stdout=handle,
            stderr=subprocess.STDOUT if handle else None,
            start_new_session=group or new_session,
            preexec_fn=_die_with_parent if die_with_parent else None,
            pass_fds=tuple(pass_fds),
        )
    finally:
        if handle:
            handle.close()  # the child's now
    return Running(name, proc, group=group, log=log, command=tuple(command))


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it should its parent die, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def send(child: Running, sig: signal.Signals) -> None:
    """`sig` to the child, or to its whole group; nothing if it is gone already."""
    try:
        if child.group:
            os.killpg(child.proc.pid, sig)  # the group's id is its leader's pid
        else:
            child.proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(
    children: Sequence[Running],
    seconds: float,
    *,
    on_kill: Callable[[Running], None] | None = None,
) -> None:
    """SIGTERM to every child still running, then each is waited for until one deadline
    `seconds` away and SIGKILLed past it (`on_kill` is told first). A group is SIGKILLed
    whole afterwards (what its leader left behind, such as an engine process) and waited for
    until none of it runs: those are not our children to wait for."""
    for child in children:
        if child.alive():
            send(child, signal.SIGTERM)
    deadline = time.monotonic() + seconds
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if on_kill:
                on_kill(child)
            send(child, signal.SIGKILL)
            child.proc.wait()
        if child.group:
            send(child, signal.SIGKILL)
            wait_group_gone(child.proc.pid)


def wait_group_gone(pgid: int, seconds: float = GROUP_GONE_SECONDS) -> None:
    """Until no process of the group runs, at most `seconds`: SIGKILL takes effect when the
    kernel gets to it, so without this a caller could exit while an engine process still
    holds its memory."""
    deadline = time.monotonic() + seconds
    while group_running(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_running(pgid: int) -> bool:
    """Whether a process of the group runs (zombies, reaped by init later, do not count);
    False where there is no /proc to read."""
    for stat in _proc_stats():
        try:
            with open(stat) as handle:
                state_and_after = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(state_and_after[2]) == pgid and state_and_after[0] != "Z":
            return True
    return False


def _proc_stats() -> list[str]:
    try:
        return [f"/proc/{entry}/stat" for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []


def log_tail(path: Path | str, lines: int = 25) -> str:
    """The last `lines` lines of a log (read from its last 64 KiB)."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, os.path.getsize(path) - LOG_TAIL_BYTES))
            return "\n".join(log.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------- readiness


def http_answers(host: str, port: int, path: str, timeout: float = 2.0) -> bool:
    """Whether ``GET path`` on host:port answers 200 now."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", path)
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def wait_until(predicate: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05) -> T:
    """Poll `predicate` until it returns something true, and return that; TimeoutError with
    its last value once `timeout` seconds have passed. A ceiling, not a wait."""
    deadline = time.monotonic() + timeout
    last = predicate()
    while not last:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition not met within {timeout} s (last value: {last!r})")
        time.sleep(interval)
        last = predicate()
    return last


def free_port(host: str = HOST) -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = HOST) -> list[int]:
    """`n` distinct free ports: each socket stays bound until all are chosen, since two
    single picks in a row can return the same port."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
