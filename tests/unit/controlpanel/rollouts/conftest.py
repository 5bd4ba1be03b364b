"""The rollouts' fleet: two workers of v1 and one of v2 behind the alias `chat` (all v1),
and no router reports but the test's own."""

from __future__ import annotations

import pytest

from controlpanel.registry.models import Alias, Worker
from controlpanel.rollouts import aliases
from tests.support.router_rows import routers_only_this_tests


@pytest.fixture
def chat(db: None) -> Alias:
    # The session's router (when a test before this one started it) reports into the same
    # database: only this test's reports count.
    routers_only_this_tests()
    for i, model in enumerate(("v1", "v1", "v2")):
        Worker.objects.create(
            url=f"http://10.0.0.{i}:8000", name=f"w{i}", source="operator", models=[{"id": model}]
        )
    return aliases.alias_create(name="chat", targets={"v1": 100}, actor="test")
