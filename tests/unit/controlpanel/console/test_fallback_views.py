"""The models page's fallbacks: names parsed in order from commas or lines, each model's
and alias's fallbacks with the requests that moved on from it (summed over the live
routers, most first), and what a refused form typed shown back for that one form only.
The page's round trip: tests/unit/controlpanel/console/test_fallbacks_page.py."""

from __future__ import annotations

import pytest
from django.utils import timezone

from controlpanel.console import fallback_views as fv
from controlpanel.registry.models import Alias, RouterInstance, ServedModel
from tests.support.in_process import staff_client
from tests.support.router_rows import routers_only_this_tests

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def no_other_routers() -> None:
    """Only this test's routers: one an earlier end-to-end test left running reports into
    the same database."""
    routers_only_this_tests()


def router(instance: str, fallbacks: list[list[object]]) -> None:
    now = timezone.now()
    RouterInstance.objects.create(instance_id=instance, hostname="h", pid=1, started_at=now,
                                  last_seen=now, fallbacks=fallbacks)  # fmt: skip


def test_names_are_read_in_order_from_commas_or_lines() -> None:
    assert fv.parse_names(" b, a\nc,,\n ") == ["b", "a", "c"]
    assert fv.parse_names("") == []


def test_fallbacks_with_the_requests_moved_and_the_typed_form() -> None:
    ServedModel.objects.create(name="m", fallbacks=["n", "chat"])
    ServedModel.objects.create(name="n")
    Alias.objects.create(name="chat", targets={"n": 100}, fallbacks=["m"])
    router("r1", [["m", "n", "no_worker", 3], ["m", "chat", "5xx", 1]])
    router("r2", [["m", "chat", "5xx", 4], ["chat", "m", "no_worker", 2]])
    typed = {"kind": "model", "name": "n", "fallbacks": "zzz"}
    models = fv.model_fallbacks(typed)
    assert models["m"] == {"fallbacks": ["n", "chat"], "typed": None,
                           "moved": [("chat", 5), ("n", 3)]}  # fmt: skip
    assert models["n"]["typed"] == "zzz"
    (alias,) = fv.alias_rows(typed)
    assert (alias["name"], alias["fallbacks"], alias["typed"]) == ("chat", ["m"], None)
    assert alias["moved"] == [("m", 2)]


def test_an_unknown_model_is_said_and_an_alias_form_sets_the_alias() -> None:
    ServedModel.objects.create(name="m")
    Alias.objects.create(name="chat", targets={"m": 100})
    browser = staff_client()
    gone = browser.post("/models/fallbacks", {"kind": "model", "name": "x", "fallbacks": "m"},
                        follow=True)  # fmt: skip
    assert "No model named x." in gone.content.decode()
    browser.post("/models/fallbacks", {"kind": "alias", "name": "chat", "fallbacks": "m"})
    assert Alias.objects.get().fallbacks == ["m"]
    cleared = browser.post("/models/fallbacks", {"kind": "alias", "name": "chat", "fallbacks": ""},
                           follow=True)  # fmt: skip
    assert "chat now falls back to none." in cleared.content.decode()
