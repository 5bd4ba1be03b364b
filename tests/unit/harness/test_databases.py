"""A run's own databases: a PostgreSQL database's URL on its server, a Redis db number's
URL, and that db emptied (the keys it held counted). Starting a PostgreSQL server needs
Debian's binaries and root: the benchmarks and tests/e2e use it, not this tier."""

from __future__ import annotations

import pytest
import redis

from harness import databases
from tests.support.common import REDIS_URL, needs_redis


@pytest.mark.parametrize(
    ("server", "url"),
    [
        ("postgresql://postgres@127.0.0.1:5432/test", "postgresql://postgres@127.0.0.1:5432/b_1"),
        ("postgresql://u:p@db.example:6543/postgres", "postgresql://u:p@db.example:6543/b_1"),
    ],
)
def test_the_databases_url_is_on_its_server(server: str, url: str) -> None:
    assert databases.PostgresDatabase(server, "b_1").url == url


def test_a_redis_url_names_its_db_number() -> None:
    assert databases.redis_url("redis://127.0.0.1:6379", 9) == "redis://127.0.0.1:6379/9"
    assert databases.redis_url("redis://127.0.0.1:6379/", 3) == "redis://127.0.0.1:6379/3"


@needs_redis
def test_flushing_empties_the_db_and_counts_what_it_held() -> None:
    """On db 15 of REDIS_URL's server: no session's own (gw0 takes 1, gw1 2, ...) nor the
    benchmarks' (9), whose state a flush would wipe."""
    server = REDIS_URL.split("://", 1)[0] + "://" + REDIS_URL.split("://", 1)[1].split("/")[0]
    url = databases.redis_url(server, 15)
    client = redis.Redis.from_url(url)
    try:
        client.set("harness-k1", "v")
        client.set("harness-k2", "v")
        assert databases.flush_redis(url) >= 2
        assert client.dbsize() == 0
        assert databases.flush_redis(url) == 0
    finally:
        client.close()
