"""The shared state a many-router benchmark runs on: its own PostgreSQL database and Redis db.

A library for ``bench/replicas.py`` and ``bench/governance.py --routers N``:
:class:`BenchDatabase` creates a fresh database (``bench_<tag>_<pid>``) on the server of a
PostgreSQL URL and drops it at the end; :func:`flush_redis` empties one Redis db number, so a
run never touches other data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import psycopg
import redis
from psycopg import sql

DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379"
DEFAULT_REDIS_DB = 9


@dataclass
class BenchDatabase:
    """A database of this run's own on the PostgreSQL server of `server_url`."""

    server_url: str
    name: str = field(default_factory=lambda: f"bench_replicas_{os.getpid()}")

    @property
    def url(self) -> str:
        base, _, _ = self.server_url.rpartition("/")
        return f"{base}/{self.name}"

    def _execute(self, statement: sql.Composable) -> None:
        with psycopg.connect(self.server_url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(statement)

    def create(self) -> None:
        self.drop()  # a leftover of a killed run with the same pid
        self._execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))

    def drop(self) -> None:
        self._execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name))
        )


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
