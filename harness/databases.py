"""Databases of a run's own: a fresh PostgreSQL database on a server, a PostgreSQL server of its
own, and one Redis db number emptied before and after.

* :class:`PostgresDatabase` creates a database (e.g. ``bench_replicas_<pid>``) on the server
  of a PostgreSQL URL and drops it at the end, so a run never touches other data.
* :class:`PostgresServer` runs Debian's PostgreSQL binaries on a port of its own, in a
  directory of its own, as the ``nobody`` user (PostgreSQL refuses to run as root): for a
  database that can really be stopped and started again.
* :func:`flush_redis` empties one Redis db number; :func:`redis_url` names it.
"""

from __future__ import annotations

import glob
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psycopg
import redis
from psycopg import sql

from harness.processes import free_port

DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379"
DEFAULT_REDIS_DB = 9
PG_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))


@dataclass
class PostgresDatabase:
    """A database called `name` on the PostgreSQL server of `server_url`."""

    server_url: str
    name: str

    @property
    def url(self) -> str:
        base, _, _ = self.server_url.rpartition("/")
        return f"{base}/{self.name}"

    def _execute(self, statement: sql.Composed) -> None:
        with psycopg.connect(self.server_url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(statement)

    def create(self) -> None:
        self.drop()  # a leftover of a killed run with the same name
        self._execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))

    def drop(self) -> None:
        self._execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name))
        )


class PostgresServer:
    """A PostgreSQL server in `root` (which must be reachable by ``nobody``: outside a
    root-only temporary directory), on a free port; :meth:`start` and :meth:`stop` as often
    as wanted."""

    def __init__(self, root: Path) -> None:
        if not PG_BIN:
            raise RuntimeError("Debian's PostgreSQL server is missing: `make postgres-server`")
        self.bin, self.data, self.port = Path(PG_BIN[-1]), root / "pgdata", free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust")

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin / tool), *args]
        shutil.chown(self.data.parent, "nobody")
        subprocess.run(["runuser", "-u", "nobody", "--", *command], check=True,
                       capture_output=True, cwd="/tmp")  # fmt: skip

    def start(self) -> None:
        opts = f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-w", "start", "-l",
                  str(self.data.parent / "pg.log"))  # fmt: skip

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")


def redis_url(base: str, db: int) -> str:
    return f"{base.rstrip('/')}/{db}"


def flush_redis(url: str) -> int:
    """FLUSHDB of the run's own db number; returns how many keys were there."""
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        keys = int(client.dbsize())
        client.flushdb()
        return keys
    finally:
        client.close()
