"""Start the routers on one shared socket and the other children once; watch them; stop
them all.

A child that dies stops everything, with a message naming it, rather than leaving a fleet
that limps on. SIGINT or SIGTERM sends SIGTERM to every child, the routers' clients (the
children started once a router answered: worker agents, demo traffic) first, so an agent's
last drain still finds a router; routers then stop accepting
and give open streams `--grace` seconds, and whatever is still running `STOP_MARGIN_SECONDS`
after that is killed. Each router child is told its place through the environment:
`CONTROLPANEL_ROUTER_INDEX` (0 to N-1) and `CONTROLPANEL_ROUTERS` (N).

A server child (`--server-child`, a real vLLM server) runs in a process group of its own:
SIGTERM and the last SIGKILL go to the whole group, since vLLM's engine runs in a process of
its own that would otherwise outlive it, holding gigabytes; it is also asked to get SIGTERM
should the supervisor itself die without stopping it. A `--url-child` (the server's worker
agent) starts once its URL answers, and is stopped first, with the routers' other clients.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

from harness.processes import Running, http_answers, log_tail, spawn, stop
from launcher.listener import ListenError, listener_bind
from launcher.plan import Child, Plan, plan_from_args

# Children get this long after SIGTERM beyond the routers' own grace for open streams.
STOP_MARGIN_SECONDS = 5.0
POLL_SECONDS = 0.2
READY_TIMEOUT_SECONDS = 60.0
# glibc's malloc for the routers: at most two arenas (its default is 8 per core), so the
# event loop, uvicorn's and libuv's threads and Django's sync thread share their free memory
# rather than each keeping its own; bench.memory measured the peak under /v1 traffic 2-5 MiB
# lower with it, at the same CPU per request. An operator's own value is kept.
ROUTER_MALLOC_ENV = {"MALLOC_ARENA_MAX": "2"}
URL_POLL_SECONDS = 1.0  # how often a --url-child's URL is asked while it is not answering
# Between children's exits (SIGCHLD) and signals, which wake it at once, the watch looks
# anyway this often: polling five times a second was most of an idle supervisor's CPU.
WATCH_SECONDS = 5.0
LOG_TAIL_LINES = 15  # of a server child's log, shown when it dies


class Supervisor:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.children: list[Running] = []
        self._clients: set[str] = set()  # started once the routers answered: they use them
        self._waiting: list[Child] = []  # --url-child processes whose URL has not answered
        self._started = time.monotonic()
        self.stopping = False

    def run(self) -> int:
        """0 when stopped by a signal, 1 when a child died or the port cannot be had."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            listener = listener_bind(self.plan.host, self.plan.port)
        except ListenError as exc:
            print(exc, file=sys.stderr)
            return 1
        try:
            with listener:
                self._start_routers(listener)
            # Only the routers hold the socket now: once they have all stopped accepting,
            # new connections are refused rather than left waiting in the backlog.
            for child in self.plan.children:
                if not child.after_ready and not child.wait_url:
                    self._start(child)
            waiting = [child for child in self.plan.children if child.after_ready]
            if waiting and self.plan.ready_path and not self._routers_ready(self.plan.ready_path):
                return 0 if self.stopping else 1
            for child in waiting:
                self._start(child)
                self._clients.add(child.name)
            self._waiting = [child for child in self.plan.children if child.wait_url]
            return self._supervise()
        finally:
            self._stop_children()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _start_routers(self, listener: socket.socket) -> None:
        count, fd = self.plan.routers, listener.fileno()
        for index in range(count):
            command = [sys.executable, "-m", "launcher.router",
                       "--fd", str(fd), "--grace", str(self.plan.grace)]  # fmt: skip
            env = {
                **ROUTER_MALLOC_ENV,
                **os.environ,
                "CONTROLPANEL_ROUTER_INDEX": str(index),
                "CONTROLPANEL_ROUTERS": str(count),
            }
            name = "router" if count == 1 else f"router-{index + 1}"
            self._spawn(name, command, env=env, pass_fds=(fd,))

    def _spawn(
        self,
        name: str,
        command: list[str],
        *,
        env: dict[str, str] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.children.append(spawn(name, command, env=env, pass_fds=pass_fds))

    def _start(self, child: Child) -> None:
        if not child.group:
            self._spawn(child.name, list(child.command))
            return
        # A real vLLM server: SIGTERMed should the supervisor die (even SIGKILLed), so
        # gigabytes of memory are not left running alone.
        log = Path(child.log) if child.log else None
        self.children.append(
            spawn(child.name, child.command, log=log, group=True, die_with_parent=True)
        )

    def _routers_ready(self, path: str) -> bool:
        """Wait until a router answers 200 on path: False when a child died, or on a signal.
        After READY_TIMEOUT_SECONDS the waiting children start anyway, with a message."""
        host = "127.0.0.1" if self.plan.host in ("0.0.0.0", "") else self.plan.host
        host = "::1" if host == "::" else host
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while not self.stopping:
            if self._one_exited():
                return False
            if http_answers(host, self.plan.port, path):
                return True
            if time.monotonic() > deadline:
                print(f"no router answered {path} in {READY_TIMEOUT_SECONDS:.0f} s; "
                      "starting the other processes anyway", file=sys.stderr)  # fmt: skip
                return True
            time.sleep(POLL_SECONDS)
        return False

    def _supervise(self) -> int:
        next_ask = 0.0
        with SignalWake() as wake:
            while not self.stopping:
                if self._one_exited():
                    return 1
                if self._waiting and time.monotonic() >= next_ask:
                    self._start_answered()
                    next_ask = time.monotonic() + URL_POLL_SECONDS
                wake.wait(URL_POLL_SECONDS if self._waiting else WATCH_SECONDS)
        return 0

    def _one_exited(self) -> bool:
        """Whether a child has exited, said with its name (and a server's last log lines)."""
        for child in self.children:
            if child.proc.poll() is not None:
                print(f"{child.name} exited with code {child.proc.returncode}; stopping",
                      file=sys.stderr)  # fmt: skip
                if child.log:
                    tail = log_tail(child.log, LOG_TAIL_LINES)
                    print(f"--- the end of {child.log} ---\n{tail}", file=sys.stderr)
                return True
        return False

    def _start_answered(self) -> None:
        """Start the --url-child processes whose URL answers now; they are routers' clients
        (a worker agent), stopped first."""
        for child in list(self._waiting):
            assert child.wait_url is not None
            url = urlsplit(child.wait_url)
            if http_answers(url.hostname or "127.0.0.1", url.port or 80, url.path or "/"):
                seconds = time.monotonic() - self._started
                print(f"{child.wait_url} answered after {seconds:.0f} s: starting {child.name}",
                      file=sys.stderr, flush=True)  # fmt: skip
                self._waiting.remove(child)
                self._start(child)
                self._clients.add(child.name)

    def _stop_children(self) -> None:
        """The routers' clients first (worker agents drain their workers through a router,
        and must not find it gone), then everything else."""
        self._stop([c for c in self.children if c.name in self._clients], STOP_MARGIN_SECONDS)
        rest = [c for c in self.children if c.name not in self._clients]
        self._stop(rest, self.plan.grace + STOP_MARGIN_SECONDS)

    def _stop(self, children: list[Running], seconds: float) -> None:
        """SIGTERM, then SIGKILL past the deadline; a server's whole group, and until none of
        it runs, so serve never exits while an engine process still holds its memory."""
        stop(children, seconds, on_kill=_say_killed)


class SignalWake:
    """Sleep until a signal comes (a child's exit, SIGCHLD, among them) or the timeout: the
    signal module writes each signal to a pipe (set_wakeup_fd) that select() waits on, so
    no signal between a check and the sleep is lost."""

    def __enter__(self) -> SignalWake:
        self._read, write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(write, False)
        self._write = write
        # The pipe is written only for signals with a Python handler; SIGCHLD has none.
        self._chld = signal.signal(signal.SIGCHLD, _ignore)
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        return self

    def wait(self, timeout: float) -> None:
        ready, _, _ = select.select([self._read], [], [], timeout)
        if ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._read, 512):
                    pass

    def __exit__(self, *exc: object) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(signal.SIGCHLD, self._chld)
        os.close(self._read)
        os.close(self._write)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """SIGCHLD's handler: only there so the signal reaches SignalWake's pipe."""


def _say_killed(child: Running) -> None:
    print(f"{child.name} did not stop in time; killing it", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    plan = plan_from_args(sys.argv[1:] if argv is None else argv)
    return Supervisor(plan).run()
