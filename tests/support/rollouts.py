"""Aliases and rollout plans made through a router's admin API, and a plan's state awaited."""

from __future__ import annotations

from typing import Any

from tests.support.common import ADMIN_HEADERS
from tests.support.servers import WAIT_CEILING_S, RouterServer, wait_until


def create_alias(router: RouterServer, name: str, targets: dict[str, int]) -> None:
    response = router.post(
        "/api/aliases", json={"name": name, "targets": targets}, headers=ADMIN_HEADERS
    )
    assert response.status_code == 201, response.text
    wait_until(lambda: name in {m["id"] for m in router.get("/v1/models").json()["data"]})


def create_plan(router: RouterServer, **body: Any) -> dict[str, Any]:
    response = router.post("/api/rollouts", json=body, headers=ADMIN_HEADERS)
    assert response.status_code == 201, response.text
    plan: dict[str, Any] = response.json()
    return plan


def plan_state(router: RouterServer, plan_id: int) -> dict[str, Any]:
    plan: dict[str, Any] = router.get(f"/api/rollouts/{plan_id}", headers=ADMIN_HEADERS).json()
    return plan


def wait_for_state(
    router: RouterServer, plan_id: int, states: set[str], timeout: float = 2 * WAIT_CEILING_S
) -> dict[str, Any]:
    found: dict[str, Any] = wait_until(
        lambda: (p := plan_state(router, plan_id))["state"] in states and p, timeout=timeout
    )
    return found
