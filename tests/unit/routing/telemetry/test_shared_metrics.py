"""/metrics for the state shared between routers (routing.telemetry.shared_metrics): absent
without Redis, and what the sync counted while Redis is away."""

from __future__ import annotations

import asyncio

from routing.state import RouterConfig, RouterState
from routing.telemetry.shared_metrics import shared_state_families
from tests.support.metrics import families_page, value


def test_without_redis_nothing_is_exported() -> None:
    assert list(shared_state_families(None)) == []


def test_a_router_whose_redis_is_away_says_so_with_what_it_moved() -> None:
    async def scenario() -> dict[str, float | None]:
        state = RouterState(RouterConfig(redis_url="redis://127.0.0.1:1/0"))
        assert state.sync is not None and state.store is not None
        try:
            state.sync.bytes_out, state.sync.credits_applied = 120, 3
            state.sync.push.received = 5
            state.admission.leases.granted["model:m"] = 4
            page = families_page(shared_state_families(state.sync))
        finally:
            await state.sync.stop()
            await state.store.close()
        return {
            "up": value(page, "controlpanel_router_shared_state_up"),
            "out": value(page, "controlpanel_router_shared_bytes_total", direction="out"),
            "pushed_in": value(
                page, "controlpanel_router_shared_load_pushes_total", direction="in"
            ),
            "credits": value(page, "controlpanel_router_shared_prefix_credits_total"),
            "lease": value(page, "controlpanel_router_lease_slots", limit="model:m"),
        }

    # Up needs a deployment to share under: an empty snapshot has none.
    assert asyncio.run(scenario()) == {
        "up": 0,
        "out": 120,
        "pushed_in": 5,
        "credits": 3,
        "lease": 4,
    }
