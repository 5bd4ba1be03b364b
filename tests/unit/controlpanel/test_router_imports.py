"""The router process imports only what its configuration uses (issue #29: its memory).

On the default configuration (no REDIS_URL, no tokenizer folder, no KV events, no tracing)
`controlpanel.asgi` leaves the optional features' libraries unimported, and so does Django's
URLconf, which the first Django request loads; the Celery app, no longer imported by the
project package, is still the one `celery -A controlpanel` and the tasks use. Each check runs
in a fresh interpreter, as a router starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.common import ROOT

# Loaded only when their feature is used: Redis (with the cryptography and opentelemetry
# redis-py loads), a tokenizer folder (tokenizers), KV events (pyzmq, msgspec), Celery, and
# httpx's command line client (rich, pygments) never.
NEVER = (
    "redis", "hiredis", "cryptography", "opentelemetry", "tokenizers", "zmq", "msgspec",
    "celery", "kombu", "billiard", "rich", "pygments",
)  # fmt: skip
# Also not before Django's first request: the admin API's libraries (ninja imports
# django.test, and with it unittest and jinja2).
NOT_AT_START = ("ninja", "pydantic", "httpx", "unittest", "jinja2")


def loaded_after(code: str, tmp_path: Path) -> set[str]:
    """The top-level packages in sys.modules after running `code` in a fresh interpreter."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CONTROLPANEL_", "OTEL_", "REDIS_URL", "DATABASE_URL"))
    }
    env.update(
        DJANGO_SETTINGS_MODULE="controlpanel.settings",
        CONTROLPANEL_VAR_DIR=str(tmp_path),
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
    )
    dump = "import json, sys; print(json.dumps(sorted(k for k, v in sys.modules.items() if v)))"
    result = subprocess.run(
        [sys.executable, "-c", f"{code}\n{dump}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    modules: list[str] = json.loads(result.stdout.splitlines()[-1])
    return {m.split(".")[0] for m in modules}


def test_the_router_starts_without_the_optional_features_libraries(tmp_path: Path) -> None:
    loaded = loaded_after("import controlpanel.asgi", tmp_path)
    assert "routing" in loaded and "django" in loaded
    assert loaded.isdisjoint(NEVER + NOT_AT_START), sorted(loaded & {*NEVER, *NOT_AT_START})


def test_djangos_urlconf_loads_no_optional_feature_either(tmp_path: Path) -> None:
    loaded = loaded_after("import controlpanel.asgi, controlpanel.urls", tmp_path)
    assert "ninja" in loaded  # the admin API's, loaded with the URLconf
    assert loaded.isdisjoint(NEVER), sorted(loaded & set(NEVER))


def test_celery_finds_the_configured_app_and_the_tasks_use_it(tmp_path: Path) -> None:
    code = """
from celery.app.utils import find_app
import django
django.setup()
app = find_app("controlpanel")  # what `celery -A controlpanel` does
from controlpanel import broker
from controlpanel.fleet.tasks import probe_workers
from controlpanel.rollouts.tasks import rollouts_tick
assert app.main == "controlpanel", app.main
assert probe_workers.app is app and rollouts_tick.app is app
assert app.conf.broker_url == f"{broker.ALIAS}://", app.conf.broker_url
"""
    assert "celery" in loaded_after(code, tmp_path)


def test_the_router_loads_no_probe_session(tmp_path: Path) -> None:
    """The router imports `probes` (worker_auth), never the probes' loop and session."""
    code = """
import sys
import controlpanel.asgi, controlpanel.urls
assert "controlpanel.fleet.probe_session" not in sys.modules
"""
    assert "django" in loaded_after(code, tmp_path)
