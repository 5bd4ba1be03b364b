"""Only a test's own router reports: the session's router (started by an end-to-end test
earlier in the same pytest process) reports into the same database every few seconds.

Deleting its row is not enough on PostgreSQL: the flush between transactional tests
already removed it, and its next report INSERTs a fresh row that the test's following
statements see (READ COMMITTED), so a drain waits for a router the test never made (CI's
run of stop 34 failed that way). Locking the table for the test's transaction makes that
report wait until the test rolls back; on SQLite the test's write lock already does."""

from __future__ import annotations

from django.db import connection

from controlpanel.registry.models import RouterInstance


def routers_only_this_tests() -> None:
    """Delete every router row and keep other processes from writing one until the test's
    transaction ends (a transactional test has none to hold the lock: it only deletes)."""
    if connection.vendor == "postgresql" and connection.in_atomic_block:
        table = connection.ops.quote_name(RouterInstance._meta.db_table)
        with connection.cursor() as cursor:
            # EXCLUSIVE blocks others' writes and SELECT ... FOR UPDATE, not their plain
            # reads; taken before the delete, so no report can hold a row lock the delete
            # would wait for while it waits for this lock (a deadlock). Released at rollback.
            cursor.execute(f"LOCK TABLE {table} IN EXCLUSIVE MODE")
    RouterInstance.objects.all().delete()
