"""Several router processes of one deployment: workers joined to all of them, a policy
set through the control plane and seen by each, their /metrics and /health, whether they
see one another through Redis, and waiting until one has read the shared budget counters."""

from __future__ import annotations

from typing import Any

import msgpack
import redis
from prometheus_client.parser import text_string_to_metric_families

from controlpanel.fleet import served_models, services
from controlpanel.registry.models import Worker
from routing.admission.budgets import SYNC_SECONDS
from simulator.server import RunningSimulator
from tests.support.servers import RouterServer, wait_until


def join(sims: list[RunningSimulator], *routers: RouterServer) -> list[Worker]:
    workers = [services.worker_add(url=sim.url, actor="test") for sim in sims]
    for router in routers:
        router.wait_routable(*workers)
    return workers


def metric(router: RouterServer, name: str, **labels: str) -> float | None:
    text = router.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def use_policy(name: str, *routers: RouterServer, **config: Any) -> None:
    served_models.served_model_set_policy(name="m", policy=name, policy_config=config, actor="t")
    for router in routers:
        wait_until(lambda r=router: metric(r, "controlpanel_router_model_policy", policy=name))


def sees(router: RouterServer, peer: RouterServer) -> bool:
    """`router` shares state with `peer` (other routers of the suite may be peers too)."""
    shared = r_health(router)["shared_state"]
    return (
        bool(shared["up"]) and r_health(peer)["shared_state"]["instance_id"] in shared["peer_ids"]
    )


def r_health(router: RouterServer) -> dict[str, Any]:
    body: dict[str, Any] = router.get("/health").json()
    return body


def published_at(router: RouterServer, store: redis.Redis) -> float:
    """When `router`'s last sync tick began (time.time()): each tick first publishes the
    router's state, stamped, in its deployment's hash of routers (routing.peers.fleet_sync)."""
    shared = r_health(router)["shared_state"]
    raw = store.hget(f"controlpanel:{shared['deployment']}:routers", shared["instance_id"])
    return float(msgpack.unpackb(raw)["ts"]) if raw else 0.0


def wait_budgets_read(router: RouterServer, store: redis.Redis, since: float) -> None:
    """Until `router` has read the shared budget counters as they stood at `since`
    (time.time()). A tick syncs the budgets, after publishing, when SYNC_SECONDS have passed
    since its last sync: so in a tick begun SYNC_SECONDS after `since` either it syncs, done
    before the next tick begins, or the last sync began after `since`, done already."""
    margin = 0.05  # the router's monotonic clock against the wall clock
    tick = wait_until(
        lambda: (at := published_at(router, store)) > since + SYNC_SECONDS + margin and at
    )
    wait_until(lambda: published_at(router, store) > tick)
