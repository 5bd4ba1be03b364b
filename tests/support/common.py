"""What tests of every tier use: the repository's root, the API credentials' headers, and
whether a real Redis is there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.conf import settings

ROOT = Path(__file__).resolve().parents[2]
# Recorded inputs: vLLM's captures, an exporter's page.
DATA = ROOT / "tests" / "data"
# Tests that need a real Redis skip without one in `make test`; CI's second tier has one and
# turns any skip into a failure (CONTROLPANEL_TESTS_NO_SKIP, tests/conftest.py).
REDIS_URL = os.environ.get("REDIS_URL", "")
needs_redis = pytest.mark.skipif(
    not REDIS_URL, reason="needs REDIS_URL (the second CI tier runs it against a real Redis)"
)
ADMIN_HEADERS = {"Authorization": f"Bearer {settings.CONTROLPANEL_ADMIN_TOKEN}"}
AGENT_HEADERS = {"Authorization": f"Bearer {settings.CONTROLPANEL_WORKER_TOKEN}"}
