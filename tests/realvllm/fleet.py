"""What the real-vLLM tier's tests share: registering the two servers with the router, and
reading the router's and vLLM's own numbers."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from controlpanel.fleet import health, served_models, services
from controlpanel.registry.models import Worker
from tests.realvllm.servers import MODEL, RealWorker
from tests.support.servers import RouterServer, wait_until

# A generous ceiling for conditions on a busy 2-core machine: real vLLM shares the cores.
PATIENCE_S = 60.0


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` in a Prometheus page whose labels include `labels`."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def router_metric(router: RouterServer, name: str, **labels: str) -> float:
    return metric(router.get("/metrics").text, name, **labels)


def vllm_metric(worker: RealWorker, name: str, **labels: str) -> float:
    return metric(httpx.get(f"{worker.url}/metrics", timeout=10).text, name, **labels)


def register(router: RouterServer, pair: list[RealWorker], *, events: bool = True) -> list[Worker]:
    """Both servers as workers of the router (with their KV events endpoints), probed once,
    routable, and with `events` their indexes trusted (the replay of each engine's history
    applied) before this returns."""
    workers = [
        services.worker_add(
            url=real.url,
            name=f"real-{i}",
            actor="test",
            kv_events=real.kv_events if events else "",
            kv_events_replay=real.kv_events_replay if events else "",
        )
        for i, real in enumerate(pair)
    ]
    health.workers_probe()
    router.wait_routable(*workers)
    for worker in workers if events else ():
        wait_until(
            lambda w=worker: router_metric(
                router, "controlpanel_router_kv_index_trusted", worker=w.name
            ),
            timeout=PATIENCE_S,
        )
    return workers


def use_policy(router: RouterServer, policy: str, **config: Any) -> None:
    served_models.served_model_set_policy(
        name=MODEL, policy=policy, policy_config=config, actor="test"
    )
    applied = f'controlpanel_router_model_policy{{model="{MODEL}",policy="{policy}"}}'
    wait_until(lambda: applied in router.get("/metrics").text, timeout=PATIENCE_S)


def kv_status(router: RouterServer, worker: Worker) -> dict[str, Any]:
    """The router's view of a worker's KV event stream and index (/list_workers); empty
    while the router has not subscribed yet (it follows the fleet twice a second)."""
    status: dict[str, Any] = router.workers()[worker.pk]["kv_events"] or {}
    return status


def quiet(router: RouterServer, worker: Worker, seconds: float = 0.3) -> None:
    """Until the worker's stream has been silent `seconds`: vLLM publishes a step's events
    after the step, so the blocks of an answer just received may still be on their way."""

    def settled() -> bool:
        age = kv_status(router, worker).get("last_batch_age_s")
        return age is None or age >= seconds

    wait_until(settled, timeout=PATIENCE_S)
