"""Test settings: the real settings module, with test tokens and short timers.

Subprocesses started by the tests (the router, Celery, agents) load this same module, so
every process of a test run agrees on tokens, expiry and the test database.
"""

import os

os.environ.setdefault("DJANGO_SECRET_KEY", "test-secret-key-" + "0123456789" * 5)
os.environ.setdefault("CONTROLPANEL_ADMIN_TOKEN", "test-admin-token-0123456789")
os.environ.setdefault("CONTROLPANEL_WORKER_TOKEN", "test-worker-token-0123456789")
os.environ.setdefault("CONTROLPANEL_HEARTBEAT_EXPIRY", "3")
os.environ.setdefault("CONTROLPANEL_HOUSEKEEPING_SECONDS", "0.5")
os.environ.setdefault("CONTROLPANEL_UPSTREAM_READ_TIMEOUT", "3")
os.environ.setdefault("CONTROLPANEL_UPSTREAM_CONNECT_TIMEOUT", "2")
os.environ.setdefault("CONTROLPANEL_MAX_BODY_BYTES", str(1024 * 1024))
os.environ.setdefault("CONTROLPANEL_DISCOVERY_TIMEOUT", "2")
os.environ.setdefault("CONTROLPANEL_ROLLOUT_TICK_SECONDS", "0.5")
os.environ.setdefault("CONTROLPANEL_EJECT_COOLDOWN", "4")
os.environ.setdefault("CONTROLPANEL_QUEUE_TIMEOUT", "1.5")
os.environ.setdefault("CONTROLPANEL_BODY_TIMEOUT", "2")
# Health from real traffic on a test's scale: every process of a run judges alike.
os.environ.setdefault("CONTROLPANEL_DEGRADED_WINDOW", "8")
os.environ.setdefault("CONTROLPANEL_DEGRADED_MIN_REQUESTS", "10")


def _redis_url_of_this_xdist_worker(url: str, worker: str) -> str:
    """`pytest -n N` runs N sessions at once: each gets a Redis database of its own (the
    channel layer, Celery's broker, the cache and the routers' shared state would mix
    otherwise). gw0 uses database 1, gw1 database 2, ... Idempotent, as subprocesses
    inherit the rewritten URL and load this module again."""
    index = int(worker.removeprefix("gw")) + 1
    head, _, tail = url.partition("://")
    netloc = tail.split("/", 1)[0].split("?", 1)[0]
    return f"{head}://{netloc}/{index}"


if os.environ.get("REDIS_URL") and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ["REDIS_URL"] = _redis_url_of_this_xdist_worker(
        os.environ["REDIS_URL"], os.environ["PYTEST_XDIST_WORKER"]
    )

from controlpanel.settings import *  # noqa: E402, F403
from controlpanel.settings import DATABASES, VAR_DIR  # noqa: E402

if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file, not memory: the router subprocess must open the same test database.
    # Per run, so two test runs on one machine never share (and corrupt) one file.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-{os.getpid()}.sqlite3")}

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
