"""What the benchmarks share: their subprocesses, readiness waits, /proc readers and JSON output.

A library, not a script: ``bench/overhead.py``, ``bench/load.py`` and
``bench/routing_policies.py`` import it, and so do their own modules (``bench/overhead_*.py``,
``bench/load_*.py``, ``bench/routing_*.py``) and ``tests/test_chaos.py``, for the socket
readers; no benchmark imports another.

* **Subprocesses.** :class:`Fleet` starts every process of a run (simulated workers, routers,
  the floor proxy, Celery) in its own session, SIGTERMed if the benchmark dies (even by
  SIGKILL), on a throw-away SQLite database and var dir; ``stop()`` ends them all and removes
  the temporary directory. :func:`start_router` can start a second router from another checkout
  (``tree``), with its own database and var dir, for before/after comparisons in one run.
* **Readiness.** :func:`wait_until` polls a check and fails fast when a child died;
  :func:`register_workers` adds workers through the router's admin API and waits until the
  router routes to all of them.
* **/proc readers.** CPU ticks of a process (:func:`cpu_times`) and of the machine
  (:func:`machine_ticks`), ``/proc/<pid>/status`` sizes (:func:`status_kib`), a process's
  sockets (:func:`socket_inodes`) and its TCP connections by inode (:func:`tcp_table`).
* **Output.** :func:`machine_info` for the report header, :func:`percentile`, :func:`log` on
  stderr, :func:`write_json` to ``bench/out/<name>-<timestamp>.json``.

:func:`run_with_fleet` is every benchmark's entry: a fresh fleet, uvloop, and all subprocesses
stopped on exit, error, SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench" / "out"
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
PYTHON = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
HOST = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")
JSON_HEADERS = {"Content-Type": "application/json"}
# A delta with at least one character of content; vLLM's first chat chunk has "content":"".
CONTENT_RE = re.compile(rb'"content":"[^"]')
DONE = b"data: [DONE]\n\n"
REGISTER_ATTEMPTS = 3
PR_SET_PDEATHSIG = 1
# Above this share of the machine busy with processes outside the benchmark, reports warn.
OTHER_LOAD_WARN_PCT = 10.0
TCP_STATES = {
    "01": "established",
    "02": "syn_sent",
    "03": "syn_recv",
    "04": "fin_wait1",
    "05": "fin_wait2",
    "06": "time_wait",
    "07": "close",
    "08": "close_wait",
    "09": "last_ack",
    "0A": "listen",
    "0B": "closing",
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- /proc readings


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of a whole process (all its threads), in seconds."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "; field 3 is fields[0]
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks summed over all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]  # user .. steal
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def status_kib(pid: int, key: str) -> int:
    """A size from /proc/<pid>/status, e.g. "VmRSS" or "VmHWM", in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def tcp_table(pid: int) -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) for every TCP socket in pid's namespace."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            local, remote, state, inode = cols[1], cols[2], cols[3], int(cols[9])
            port = int(local.rsplit(":", 1)[1], 16)
            remote_port = int(remote.rsplit(":", 1)[1], 16)
            table[inode] = (port, remote_port, TCP_STATES.get(state, state))
    return table


def socket_inodes(pid: int) -> tuple[int, list[int]]:
    """(open fds, inodes of the fds that are sockets) of a process."""
    fd_dir = Path(f"/proc/{pid}/fd")
    fds = os.listdir(fd_dir)
    inodes = []
    for fd in fds:
        with contextlib.suppress(FileNotFoundError):  # closed while we looked
            target = os.readlink(fd_dir / fd)
            if target.startswith("socket:["):
                inodes.append(int(target[8:-1]))
    return len(fds), inodes


def machine_info() -> dict[str, Any]:
    model = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "kernel": platform.release(),
    }


# --------------------------------------------------------------------------- subprocesses


class Fleet:
    """The subprocesses a benchmark starts, and nothing else; stop() is idempotent."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
        self.token = secrets.token_hex(16)
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
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

    def tree_env(self, name: str, tree: Path) -> dict[str, str]:
        """What a process started from another checkout needs on top of the fleet's env: that
        checkout's code first on the path, and a var dir and database of its own."""
        if tree == ROOT:
            return {}
        var_dir = self.tmp / name
        var_dir.mkdir(exist_ok=True)
        return {
            "PYTHONPATH": str(tree),
            "CONTROLPANEL_VAR_DIR": str(var_dir),
            "DATABASE_URL": f"sqlite:///{var_dir / 'bench.sqlite3'}",
        }

    def spawn(
        self,
        name: str,
        args: list[str],
        extra_env: dict[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            args,
            cwd=cwd,
            env={**self.env, **(extra_env or {})},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop them in order
            preexec_fn=_die_with_parent,
        )
        log.close()
        self.procs.append((name, proc))
        return proc

    def run(
        self, args: list[str], extra_env: dict[str, str] | None = None, cwd: Path = ROOT
    ) -> None:
        env = {**self.env, **(extra_env or {})}
        result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed:\n{result.stderr.decode()[-2000:]}")

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def log_tail(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the benchmark dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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
) -> int:
    """The router (uvicorn serving ``controlpanel.asgi``) on a freshly migrated database.

    ``tree`` is the checkout it runs from: another one (e.g. the code before a change) gets
    the same command, flags and environment, with cwd and PYTHONPATH set to it and its own
    database and var dir (:meth:`Fleet.tree_env`). Returns the pid.
    """
    env = fleet.tree_env(name, tree)
    fleet.run([PYTHON, "manage.py", "migrate", "--noinput"], extra_env=env, cwd=tree)
    proc = fleet.spawn(
        name,
        [
            PYTHON, "-m", "uvicorn", "controlpanel.asgi:application", "--host", HOST,
            "--port", str(port), "--lifespan", "on", "--no-access-log", *extra_args,
        ],
        extra_env=env,
        cwd=tree,
    )  # fmt: skip
    return proc.pid


def start_floor(
    fleet: Fleet, port: int, upstreams: dict[str, list[str]], name: str = "floor"
) -> int:
    """bench/floor_proxy.py, with exactly the uvicorn flags the router gets."""
    spec = ";".join(f"{model}={','.join(urls)}" for model, urls in upstreams.items())
    proc = fleet.spawn(
        name,
        [
            PYTHON, "-m", "uvicorn", "bench.floor_proxy:app", "--host", HOST,
            "--port", str(port), "--lifespan", "on", "--no-access-log",
        ],
        extra_env={"FLOOR_UPSTREAMS": spec},
    )  # fmt: skip
    return proc.pid


# --------------------------------------------------------------------------- readiness


async def wait_until(
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


async def http_ok(session: aiohttp.ClientSession, url: str) -> bool:
    async with session.get(url) as resp:
        await resp.read()
        return resp.status == 200


async def post_ok(session: aiohttp.ClientSession, url: str, body: bytes) -> bool:
    async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
        await resp.read()
        return resp.status == 200


async def register_worker(
    session: aiohttp.ClientSession,
    fleet: Fleet,
    router: str,
    url: str,
    name: str = "router",
    extra: dict[str, Any] | None = None,
) -> None:
    """POST /api/workers; a 5xx is retried (a 409 on a retry means the first try landed).
    `name` is the router's process name in the fleet, for its log; `extra`, more fields of
    the body (e.g. ``kv_events``)."""
    headers = {"Authorization": f"Bearer {fleet.token}"}
    body = {"url": url, **(extra or {})}
    for attempt in range(1, REGISTER_ATTEMPTS + 1):
        async with session.post(f"{router}/api/workers", json=body, headers=headers) as r:
            text = await r.text()
        if r.status == 201 or (r.status == 409 and attempt > 1):
            return
        if r.status < 500 or attempt == REGISTER_ATTEMPTS:
            raise RuntimeError(
                f"registering {url}: HTTP {r.status} {text[:300]}\n"
                f"{name} log:\n{fleet.log_tail(name)}"
            )
        log(f"registering {url}: HTTP {r.status}, retrying; {name} log:\n{fleet.log_tail(name)}")
        await asyncio.sleep(0.5)


async def listed_workers(session: aiohttp.ClientSession, router: str) -> list[dict[str, Any]]:
    """The router's ``GET /list_workers``: every worker it knows, with its state and loads."""
    async with session.get(f"{router}/list_workers") as resp:
        listed: list[dict[str, Any]] = orjson.loads(await resp.read())["workers"]
    return listed


async def register_workers(
    session: aiohttp.ClientSession,
    fleet: Fleet,
    router: str,
    urls: list[str],
    name: str = "router",
    extra: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Register every worker, then wait until the router lists all of them as routable.
    `extra`: more body fields by worker URL (register_worker)."""
    for url in urls:
        await register_worker(session, fleet, router, url, name, (extra or {}).get(url))

    async def all_routable() -> bool:
        workers = await listed_workers(session, router)
        return sum(1 for w in workers if w["routable"]) == len(urls)

    await wait_until("all workers routable", all_routable, fleet, timeout=30)


# --------------------------------------------------------------------------- results


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of unsorted values."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def write_json(name: str, result: dict[str, Any]) -> Path:
    """bench/out/<name>-<UTC timestamp>.json; returns its path."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = OUT_DIR / f"{name}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


# --------------------------------------------------------------------------- entry point


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
        log("interrupted; stopping subprocesses")
        return None
    finally:
        fleet.stop()
