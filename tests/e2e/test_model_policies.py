"""Choosing a model's balancing policy at run time, through the API and the dashboard."""

from __future__ import annotations

import httpx
import pytest

from controlpanel.registry.models import Event, ServedModel
from tests.support.common import ADMIN_HEADERS
from tests.support.servers import AddWorker, RouterServer, StartSimulator

pytestmark = pytest.mark.django_db(transaction=True)


def patch_policy(router: RouterServer, model: str, body: dict[str, object]) -> httpx.Response:
    return httpx.patch(f"{router.url}/api/models/{model}", json=body, headers=ADMIN_HEADERS)


def test_models_api_lists_and_changes_policies(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("org/m"))
    listed = router.get("/api/models", headers=ADMIN_HEADERS).json()
    assert listed == [
        {"name": "org/m", "policy": "shortest_queue", "policy_config": {}, "max_inflight": 0,
         "preflight": "warn", "tokenizer": "", "priority_reserve": 0.2, "fallbacks": [],
         "pd_bypass_tokens": 256,
         "workers": [worker.pk],
         "updated_at": listed[0]["updated_at"]}
    ]  # fmt: skip
    assert "shortest_queue" in router.get("/api/policies", headers=ADMIN_HEADERS).json()
    changed = patch_policy(router, "org/m", {"policy": "shortest_queue", "policy_config": {}})
    assert changed.status_code == 200 and changed.json()["policy"] == "shortest_queue"
    assert Event.objects.filter(kind="policy_changed").count() == 1


def test_bad_policy_changes_are_refused_clearly(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    add_worker(simulator("m"))
    unknown = patch_policy(router, "m", {"policy": "fastest"})
    assert unknown.status_code == 422
    assert "unknown policy 'fastest'" in unknown.json()["error"]["message"]
    assert patch_policy(router, "nope", {"policy": "shortest_queue"}).status_code == 404
    no_auth = httpx.patch(f"{router.url}/api/models/m", json={"policy": "shortest_queue"})
    assert no_auth.status_code == 401
    assert ServedModel.objects.get(name="m").policy == "shortest_queue"


def test_worker_weight_and_name_can_be_changed(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("m"))
    response = httpx.patch(
        f"{router.url}/api/workers/{worker.pk}",
        json={"weight": 2.5, "name": "renamed"},
        headers=ADMIN_HEADERS,
    )
    assert response.status_code == 200 and response.json()["name"] == "renamed"
    worker.refresh_from_db()
    assert worker.weight == 2.5
    negative = httpx.patch(
        f"{router.url}/api/workers/{worker.pk}", json={"weight": -1}, headers=ADMIN_HEADERS
    )
    assert negative.status_code == 422
    router.wait_for(lambda seen: seen[worker.pk]["name"] == "renamed")


def test_dashboard_changes_a_policy(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    from tests.support.login import logged_in

    add_worker(simulator("m"))
    session = logged_in(router)
    token = session.cookies["csrftoken"]
    page = session.get("/models/").text
    assert 'data-testid="policy-select"' in page and "prefix_aware" in page
    form = {"model": "m", "policy": "round_robin", "policy_config": "{}",
            "csrfmiddlewaretoken": token}  # fmt: skip
    assert session.post("/models/policy", data=form).status_code == 302
    assert "m is now balanced with round_robin." in session.get("/models/").text
    assert ServedModel.objects.get(name="m").policy == "round_robin"
    bad = {**form, "policy": "least_kv", "policy_config": '{"max_metrics_age": "soon"'}
    session.post("/models/policy", data=bad)
    assert "Policy of m not changed" in session.get("/models/").text
    assert ServedModel.objects.get(name="m").policy == "round_robin"
