"""A model's balancing policy switched through a router's admin API, and read back from
its /metrics; a fleet of simulated workers of model "m"."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from controlpanel.registry.models import Worker
from simulator.server import RunningSimulator
from tests.support.common import ADMIN_HEADERS
from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until


def use_policy(router: RouterServer, model: str, policy: str, **config: object) -> None:
    """Switch the policy and wait until the router uses it (how soon is a speed figure)."""
    response = httpx.patch(
        f"{router.url}/api/models/{model}",
        json={"policy": policy, "policy_config": config},
        headers=ADMIN_HEADERS,
    )
    assert response.status_code == 200, response.text
    wait_until(lambda: policy_in_use(router, model) == policy, interval=0.02)


def policy_in_use(router: RouterServer, model: str) -> str | None:
    for family in text_string_to_metric_families(router.get("/metrics").text):
        if family.name == "controlpanel_router_model_policy":
            for sample in family.samples:
                if sample.labels["model"] == model:
                    return sample.labels["policy"]
    return None


def fleet(
    simulator: StartSimulator, add_worker: AddWorker, n: int = 3
) -> tuple[list[RunningSimulator], list[Worker]]:
    sims = [simulator("m") for _ in range(n)]
    return sims, [add_worker(sim, name=f"w{i}") for i, sim in enumerate(sims)]
