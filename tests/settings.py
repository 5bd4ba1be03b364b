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

from controlpanel.settings import *  # noqa: F403
from controlpanel.settings import DATABASES, VAR_DIR

if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file, not memory: the router subprocess must open the same test database.
    # Per run, so two test runs on one machine never share (and corrupt) one file.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-{os.getpid()}.sqlite3")}

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
