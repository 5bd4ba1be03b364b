"""The control plane's Prometheus page (controlpanel.routers.exposition), through Django's
test client: rollouts per alias with every state present, the active plan, and client keys'
usage by public prefix, never a secret."""

from __future__ import annotations

from datetime import date

import pytest
from django.test import Client

from controlpanel.keys import services as keys
from controlpanel.registry.choices import RolloutState
from controlpanel.registry.models import Alias, RolloutPlan, ServedModel
from routing.telemetry.counters import CONTENT_TYPE
from tests.support.metrics import Samples, parse, value

pytestmark = pytest.mark.django_db


def page() -> tuple[Samples, str]:
    response = Client().get("/metrics/control-plane")
    assert response.status_code == 200 and response["Content-Type"] == CONTENT_TYPE
    text = response.content.decode()
    return parse(text), text


def plan(alias: Alias, state: str, to: str = "v2") -> None:
    RolloutPlan.objects.create(
        alias=alias, from_target="v1", to_target=to, steps=[{"weight": 100}], state=state
    )


def test_rollouts_per_alias_with_every_state_and_the_active_one() -> None:
    chat = Alias.objects.create(name="chat", targets={"v1": 100})
    Alias.objects.create(name="idle", targets={"v1": 100})  # no plan: no series
    plan(chat, RolloutState.ROLLED_BACK)
    plan(chat, RolloutState.ROLLED_BACK, to="v3")
    plan(chat, RolloutState.PAUSED)
    samples, _ = page()
    states = {
        state: value(samples, "controlpanel_rollouts", alias="chat", state=state)
        for state in RolloutState.values
    }
    assert states == {state: 0.0 for state in RolloutState.values} | {
        "rolled_back": 2.0, "paused": 1.0,
    }  # fmt: skip
    assert not [k for k in samples if ("alias", "idle") in k[1]]
    active = [k for k in samples if k[0] == "controlpanel_rollout_active"]
    assert active == [
        ("controlpanel_rollout_active",
         frozenset({("alias", "chat"), ("from_target", "v1"), ("to_target", "v2")}))
    ]  # fmt: skip


def test_key_usage_by_prefix_summed_over_days_never_the_secret() -> None:
    ServedModel.objects.create(name="m")
    issued = keys.api_key_create(name="team", actor="ops")
    prefix = issued.record.prefix
    for day in (date(2026, 1, 1), date(2026, 1, 2)):
        keys.usage_record(usage={(issued.record.pk, "m"): (2, 100, 7)}, day=day)
    samples, text = page()
    assert value(samples, "controlpanel_key_requests_total", key=prefix, model="m") == 4
    tokens = "controlpanel_key_tokens_total"
    assert value(samples, tokens, key=prefix, model="m", kind="prompt") == 200
    assert value(samples, tokens, key=prefix, model="m", kind="completion") == 14
    assert issued.secret not in text and issued.record.key_hash not in text


def test_only_get_is_answered() -> None:
    assert Client().post("/metrics/control-plane").status_code == 405
