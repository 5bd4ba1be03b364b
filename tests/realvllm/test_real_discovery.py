"""A real vLLM server added without KV events endpoints (the admin API, as an operator or an
agent would) gets them from its own GET /kv_event_sources, and the router follows them."""

from __future__ import annotations

import httpx
import pytest

from controlpanel.fleet import health
from controlpanel.registry.models import Worker
from tests.realvllm.fleet import PATIENCE_S, kv_status
from tests.realvllm.servers import RealWorker
from tests.support.common import ADMIN_HEADERS
from tests.support.servers import RouterServer, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_endpoints_are_read_from_the_worker_and_followed(
    router: RouterServer, vllm_pair: list[RealWorker]
) -> None:
    real = vllm_pair[0]
    added = httpx.post(
        f"{router.url}/api/workers", json={"url": real.url, "name": "discovered"},
        headers=ADMIN_HEADERS, timeout=60,
    )  # fmt: skip
    assert added.status_code in (200, 201), added.text
    worker = Worker.objects.get(name="discovered")
    # vLLM says tcp://*:PORT; the router must reach it at the worker's own host.
    assert (worker.kv_events, worker.kv_events_replay) == (real.kv_events, real.kv_events_replay)
    health.workers_probe()
    router.wait_routable(worker)
    wait_until(
        lambda: (kv_status(router, worker).get("index") or {}).get("trust") == "ready",
        timeout=PATIENCE_S,
    )
    assert kv_status(router, worker)["connected"] is True


def test_an_operators_endpoint_wins_and_an_empty_one_keeps_events_off(
    router: RouterServer, vllm_pair: list[RealWorker]
) -> None:
    real = vllm_pair[1]
    body = {"url": real.url, "name": "events-off", "kv_events": ""}
    added = httpx.post(f"{router.url}/api/workers", json=body, headers=ADMIN_HEADERS, timeout=60)
    assert added.status_code in (200, 201), added.text
    worker = Worker.objects.get(name="events-off")
    assert (worker.kv_events, worker.kv_events_replay) == ("", "")
