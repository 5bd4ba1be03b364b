"""The launcher's command line: how many routers, where they listen, how long open streams
get on stop, and the other processes to run once (Celery, the demo fleet, real vLLM servers).

`manage.py serve` writes this command line; run by hand it is `python -m launcher --help`.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Child:
    """A process the launcher runs once, beside the routers, and stops with them."""

    name: str
    command: tuple[str, ...]
    # Started once a router answers the plan's ready_path: a process that talks to the
    # router (an agent registering) would otherwise start by warning it is unreachable.
    after_ready: bool = False
    # Started once this URL answers 200: an agent whose vLLM server takes a minute to load
    # would otherwise fail to register (and say so) every few seconds meanwhile.
    wait_url: str | None = None
    # A process group of its own, which SIGTERM and the last SIGKILL reach as a whole: vLLM
    # runs its engine in a child process that must not outlive the server.
    group: bool = False
    log: str | None = None  # its output appended here rather than to the console


@dataclass(frozen=True)
class Plan:
    routers: int
    host: str
    port: int
    grace: int  # seconds each router gives open streams after SIGTERM
    children: tuple[Child, ...]
    ready_path: str | None = None  # None: the after_ready children start at once too


def plan_from_args(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> Plan:
    """The plan the command line asks for; exits with a usage message when it is refused."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.routers > 1 and not (environ.get("REDIS_URL") or environ.get("REDIS_URL_FILE")):
        # Several routers share prefix knowledge, load and admission limits through Redis;
        # without it each would route on its own view, which is not what was asked for.
        parser.error(f"--routers {args.routers} needs REDIS_URL (the routers share state there)")
    children = (
        *(Child(name, tuple(shlex.split(line))) for name, line in args.child),
        *(Child(name, tuple(shlex.split(line)), group=True, log=log)
          for name, log, line in args.server_child),
        *(Child(name, tuple(shlex.split(line)), after_ready=True)
          for name, line in args.ready_child),
        *(Child(name, tuple(shlex.split(line)), wait_url=url)
          for name, url, line in args.url_child),
    )  # fmt: skip
    for child in children:
        if child.wait_url and not child.wait_url.startswith("http://"):
            parser.error(f"--url-child {child.name}: {child.wait_url} is not an http:// URL")
    return Plan(args.routers, args.host, args.port, args.grace, children, args.ready_path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launcher",
        description="Serve the control panel from N router processes on one port, "
        "with other processes beside them; SIGINT or SIGTERM stops them all.",
    )
    parser.add_argument("--routers", type=_at_least(1), default=1, metavar="N")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_at_least(0), default=8000)
    parser.add_argument(
        "--grace",
        type=_at_least(0),
        default=30,
        metavar="SECONDS",
        help="how long each router lets open streams finish after SIGTERM",
    )
    parser.add_argument(
        "--ready-path",
        metavar="PATH",
        help="start the --ready-child processes once a router answers 200 on this path",
    )
    parser.add_argument(
        "--ready-child",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "COMMAND"),
        help="like --child, started once a router answers --ready-path (repeatable)",
    )
    parser.add_argument(
        "--child",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "COMMAND"),
        help="another process to run once, as one shell-quoted command line (repeatable)",
    )
    parser.add_argument(
        "--server-child",
        nargs=3,
        action="append",
        default=[],
        metavar=("NAME", "LOG", "COMMAND"),
        help="like --child, in a process group of its own that SIGTERM reaches as a whole "
        "(a vLLM server and its engine processes), its output appended to LOG (repeatable)",
    )
    parser.add_argument(
        "--url-child",
        nargs=3,
        action="append",
        default=[],
        metavar=("NAME", "URL", "COMMAND"),
        help="like --child, started once URL (http://) answers 200, e.g. a worker agent "
        "waiting for its vLLM server (repeatable)",
    )
    return parser


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError(text)
        return value

    parse.__name__ = f"integer >= {minimum}"  # what argparse names in its error
    return parse
