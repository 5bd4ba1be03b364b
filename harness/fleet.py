"""The processes of one benchmark run: simulated workers, routers, Celery, whatever else it
starts, on a throw-away SQLite database and var dir, and all stopped at the end.

* :class:`Fleet` starts every child in a session of its own (a Ctrl-C reaches only the
  benchmark, which stops them in order), SIGTERMed should the benchmark die (even by
  SIGKILL), logging to ``<tmp>/<name>.log``; :meth:`Fleet.stop` ends them all and removes the
  temporary directory. :meth:`Fleet.tree_env` runs a child from another checkout (the code
  before a change) with its own database and var dir.
* :func:`start_router` (uvicorn serving ``controlpanel.asgi`` on a freshly migrated database)
  and :func:`start_simulated_worker` (``manage.py simulate_vllm``): the project is started by
  its command lines, never imported.
* :func:`wait_ready` polls an async check and fails fast when a child died;
  :func:`run_with_fleet` is every benchmark's entry: a fresh fleet, uvloop, and every child
  stopped on exit, error, SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from harness.processes import HOST, Running, spawn, stop

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
PYTHON = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
STOP_SECONDS = 5.0  # SIGTERM, then SIGKILL after this
# What launcher.supervisor and deploy/kubernetes give a router process (launcher.supervisor's
# ROUTER_MALLOC_ENV says why), so the benchmarks measure the router as it is run.
ROUTER_ENV = {"MALLOC_ARENA_MAX": "2"}
# The router's command line (after "python -m") per ASGI server, the address to follow.
SERVERS = {
    "uvicorn": (
        "uvicorn", "controlpanel.asgi:application", "--lifespan", "on", "--no-access-log",
    ),
    "granian": (
        "granian", "--interface", "asgi", "--workers", "1", "--loop", "uvloop",
        "--no-access-log", "controlpanel.asgi:application",
    ),
}  # fmt: skip

__all__ = [
    "HOST", "PYTHON", "ROOT", "Fleet", "run_async", "run_with_fleet", "start_router",
    "start_simulated_worker", "wait_ready",
]  # fmt: skip


class Fleet:
    """The subprocesses a benchmark starts, and nothing else; stop() is idempotent."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
        self.token = secrets.token_hex(16)
        self.procs: list[Running] = []
        self.env = self._env()

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPANEL_")}
        for key in ("DATABASE_URL", "REDIS_URL", "DJANGO_DEBUG", "DJANGO_SETTINGS_MODULE"):
            env.pop(key, None)
        env.update(
            DJANGO_SETTINGS_MODULE="controlpanel.settings",
            CONTROLPANEL_VAR_DIR=str(self.tmp),
            DATABASE_URL=f"sqlite:///{self.tmp / 'bench.sqlite3'}",
            CONTROLPANEL_ADMIN_TOKEN=self.token,
            PYTHONUNBUFFERED="1",
        )
        return env

    def tree_env(self, name: str, tree: Path, own_db: bool = False) -> dict[str, str]:
        """What a process started from another checkout needs on top of the fleet's env: that
        checkout's code first on the path, and a var dir and database of its own (with
        `own_db`, also from this checkout)."""
        if tree == ROOT and not own_db:
            return {}
        var_dir = self.tmp / name
        var_dir.mkdir(exist_ok=True)
        return {
            **({"PYTHONPATH": str(tree)} if tree != ROOT else {}),
            "CONTROLPANEL_VAR_DIR": str(var_dir),
            "DATABASE_URL": f"sqlite:///{var_dir / 'bench.sqlite3'}",
        }

    def spawn(
        self,
        name: str,
        args: Sequence[str],
        extra_env: dict[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> Running:
        child = spawn(
            name,
            args,
            env={**self.env, **(extra_env or {})},
            cwd=cwd,
            log=self.tmp / f"{name}.log",
            append=False,
            new_session=True,  # Ctrl-C reaches only us; we stop them in order
            die_with_parent=True,
            stdin=subprocess.DEVNULL,
        )
        self.procs.append(child)
        return child

    def run(
        self, args: list[str], extra_env: dict[str, str] | None = None, cwd: Path = ROOT
    ) -> None:
        env = {**self.env, **(extra_env or {})}
        result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed:\n{result.stderr.decode()[-2000:]}")

    def child(self, name: str) -> Running:
        return next(child for child in self.procs if child.name == name)

    def check_alive(self) -> None:
        for child in self.procs:
            if not child.alive():
                code = child.proc.returncode
                raise RuntimeError(f"{child.name} exited with {code}:\n{child.log_tail()}")

    def log_tail(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop_named(
        self,
        names: Sequence[str],
        seconds: float = STOP_SECONDS,
        on_kill: Callable[[Running], None] | None = None,
    ) -> list[Running]:
        """Stop the children of these names (SIGTERM in the order given, one deadline) and
        forget them; returns them (for a restart with the same command)."""
        mine = [child for name in names for child in self.procs if child.name == name]
        stop(mine, seconds, on_kill=on_kill)
        self.procs[:] = [child for child in self.procs if child not in mine]
        return mine

    def stop(self) -> None:
        stop(self.procs, STOP_SECONDS)
        self.procs.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


def start_simulated_worker(
    fleet: Fleet, name: str, port: int, model: str, ttft: float, itl: float, max_batch: int = 512
) -> None:
    """``manage.py simulate_vllm`` with no per-block prefill cost (always from this checkout)."""
    fleet.spawn(
        name,
        [
            PYTHON, "manage.py", "simulate_vllm", "--host", HOST, "--port", str(port),
            "--model", model, "--ttft-ms", str(ttft), "--itl-ms", str(itl),
            "--prefill-ms-per-block", "0", "--max-batch", str(max_batch),
        ],
    )  # fmt: skip


def start_router(
    fleet: Fleet,
    port: int,
    *,
    name: str = "router",
    tree: Path = ROOT,
    extra_args: Sequence[str] = (),
    server: str = "uvicorn",
) -> int:
    """The router (uvicorn serving ``controlpanel.asgi``) on a freshly migrated database.

    ``tree`` is the checkout it runs from: another one (e.g. the code before a change) gets
    the same command, flags and environment, with cwd and PYTHONPATH set to it and its own
    database and var dir (:meth:`Fleet.tree_env`). ``server="granian"`` serves the same app
    with granian instead (ASGI, one worker process, uvloop, no access log; its lifespan is
    on by default) on a database and var dir of its own. Returns the pid (for granian, its
    supervisor's: the worker is its child).
    """
    if server not in SERVERS:
        raise ValueError(f"unknown server {server!r}: {', '.join(SERVERS)}")
    env = {k: v for k, v in ROUTER_ENV.items() if k not in fleet.env}  # the caller's first
    env.update(fleet.tree_env(name, tree, own_db=server != "uvicorn"))
    fleet.run([PYTHON, "manage.py", "migrate", "--noinput"], extra_env=env, cwd=tree)
    args = [*SERVERS[server], "--host", HOST, "--port", str(port), *extra_args]
    child = fleet.spawn(name, [PYTHON, "-m", *args], extra_env=env, cwd=tree)
    return child.pid


async def wait_ready(
    what: str, check: Callable[[], Awaitable[bool]], fleet: Fleet, timeout: float = 60.0
) -> None:
    """Poll check() every 0.1 s; bounded by timeout, and fails fast if a child died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fleet.check_alive()
        try:
            if await check():
                return
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def run_async(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """uvloop when installed (as uvicorn uses it), so the client costs as little as it can."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_with_fleet(
    benchmark: Callable[[Fleet], Coroutine[Any, Any, dict[str, Any]]],
) -> dict[str, Any] | None:
    """Run `benchmark` on a fresh fleet; every subprocess is stopped on exit, error, SIGTERM or
    Ctrl-C. Returns None when interrupted (the caller exits with 130)."""
    fleet = Fleet()
    atexit.register(fleet.stop)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run_async(benchmark(fleet))
    except KeyboardInterrupt:
        print("interrupted; stopping subprocesses", file=sys.stderr, flush=True)
        return None
    finally:
        fleet.stop()
