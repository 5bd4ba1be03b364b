"""Start the routers on one shared socket and the other children once; watch them; stop
them all.

A child that dies stops everything, with a message naming it, rather than leaving a fleet
that limps on. SIGINT or SIGTERM sends SIGTERM to every child, the routers' clients (the
children started once a router answered: worker agents, demo traffic) first, so an agent's
last drain still finds a router; routers then stop accepting
and give open streams `--grace` seconds, and whatever is still running `STOP_MARGIN_SECONDS`
after that is killed. Each router child is told its place through the environment:
`CONTROLPANEL_ROUTER_INDEX` (0 to N-1) and `CONTROLPANEL_ROUTERS` (N).
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

from launcher.listener import ListenError, listener_bind
from launcher.plan import Plan, plan_from_args

# Children get this long after SIGTERM beyond the routers' own grace for open streams.
STOP_MARGIN_SECONDS = 5.0
POLL_SECONDS = 0.2
READY_TIMEOUT_SECONDS = 60.0


class Supervisor:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._clients: set[str] = set()  # started once the routers answered: they use them
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
                if not child.after_ready:
                    self._spawn(child.name, list(child.command))
            waiting = [child for child in self.plan.children if child.after_ready]
            if waiting and self.plan.ready_path and not self._routers_ready(self.plan.ready_path):
                return 0 if self.stopping else 1
            for child in waiting:
                self._spawn(child.name, list(child.command))
                self._clients.add(child.name)
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
        self.children.append((name, subprocess.Popen(command, env=env, pass_fds=pass_fds)))

    def _routers_ready(self, path: str) -> bool:
        """Wait until a router answers 200 on path: False when a child died, or on a signal.
        After READY_TIMEOUT_SECONDS the waiting children start anyway, with a message."""
        host = "127.0.0.1" if self.plan.host in ("0.0.0.0", "") else self.plan.host
        host = "::1" if host == "::" else host
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while not self.stopping:
            for name, child in self.children:
                if child.poll() is not None:
                    print(f"{name} exited with code {child.returncode}; stopping", file=sys.stderr)
                    return False
            if _answers(host, self.plan.port, path):
                return True
            if time.monotonic() > deadline:
                print(f"no router answered {path} in {READY_TIMEOUT_SECONDS:.0f} s; "
                      "starting the other processes anyway", file=sys.stderr)  # fmt: skip
                return True
            time.sleep(POLL_SECONDS)
        return False

    def _supervise(self) -> int:
        while not self.stopping:
            for name, child in self.children:
                if child.poll() is not None:
                    print(f"{name} exited with code {child.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(POLL_SECONDS)
        return 0

    def _stop_children(self) -> None:
        """The routers' clients first (worker agents drain their workers through a router,
        and must not find it gone), then everything else."""
        clients = [(n, c) for n, c in self.children if n in self._clients]
        self._stop(clients, STOP_MARGIN_SECONDS)
        rest = [(n, c) for n, c in self.children if n not in self._clients]
        self._stop(rest, self.plan.grace + STOP_MARGIN_SECONDS)

    def _stop(self, children: list[tuple[str, subprocess.Popen[bytes]]], seconds: float) -> None:
        for _, child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + seconds
        for name, child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{name} did not stop in time; killing it", file=sys.stderr)
                child.kill()
                child.wait()


def _answers(host: str, port: int, path: str) -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=2)
    try:
        connection.request("GET", path)
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def main(argv: Sequence[str] | None = None) -> int:
    plan = plan_from_args(sys.argv[1:] if argv is None else argv)
    return Supervisor(plan).run()
