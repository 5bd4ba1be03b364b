"""The unit tier: tests in this process, laid out as the code they test (routing/,
controlpanel/, simulator/, deploy/). They may use the database, a Redis that REDIS_URL
names, short-lived tools (kubectl, promtool, `python -c`) and an in-process socket
standing in for a peer, but start no server of the project's: no router, simulator,
Celery, Prometheus or browser. Those are tests/e2e/ and tests/browser/.
"""

from __future__ import annotations

import pytest

# The fixtures of tests/conftest.py that start the project's servers.
SERVERS = frozenset(
    {"router", "keyed_router", "simulator", "sim_loop", "add_worker", "celery_worker"}
)


def pytest_runtest_setup(item: pytest.Item) -> None:
    started = SERVERS.intersection(getattr(item, "fixturenames", ()))
    if started:
        pytest.fail(
            f"a unit test starts no server, but this one uses {sorted(started)}: "
            "it belongs in tests/e2e/",
            pytrace=False,
        )
