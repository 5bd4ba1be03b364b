"""tests.support.router_rows: while a test holds the router rows, another process's report
cannot add one behind its back (CI failed once on a session router's report that did)."""

from __future__ import annotations

import pytest
from django.db import OperationalError, connections

from controlpanel.registry.models import RouterInstance
from tests.support.router_rows import routers_only_this_tests

JSON_COLUMNS = ("inflight", "recent", "traffic", "window", "kv_events", "classes")


def insert_a_router_row_elsewhere() -> None:
    """What a router's first report does, on a connection of its own that gives up on a lock
    after half a second instead of waiting for the test to end."""
    other = connections.create_connection("default")
    quote = other.ops.quote_name
    columns = ["instance_id", "hostname", "pid", "started_at", "last_seen", "generation"]
    values = ["'elsewhere'", "'h'", "1", "CURRENT_TIMESTAMP", "CURRENT_TIMESTAMP", "0"]
    columns += [*JSON_COLUMNS, "fallbacks"]
    values += ["'{}'"] * len(JSON_COLUMNS) + ["'[]'"]
    table = quote(RouterInstance._meta.db_table)
    names = ", ".join(quote(column) for column in columns)
    timeout, reset = (
        ("SET lock_timeout = '500ms'", "RESET lock_timeout")
        if other.vendor == "postgresql"
        else ("PRAGMA busy_timeout = 500", "")
    )
    try:
        with other.cursor() as cursor:
            cursor.execute(timeout)
            try:
                cursor.execute(f"INSERT INTO {table} ({names}) VALUES ({', '.join(values)})")
            finally:
                if reset:
                    cursor.execute(reset)
    finally:
        other.close()


@pytest.mark.django_db
def test_another_connection_cannot_add_a_router_while_a_test_holds_the_rows() -> None:
    routers_only_this_tests()
    with pytest.raises(OperationalError):
        insert_a_router_row_elsewhere()
    assert not RouterInstance.objects.exists()
