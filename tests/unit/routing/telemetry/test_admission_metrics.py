"""/metrics for admission control (routing.telemetry.admission_metrics), from a real
router's admission: waiting, admitted and shed by class, capped asks and budget refusals."""

from __future__ import annotations

import asyncio
from typing import Any

from bench.common.workers import worker_view
from routing.admission.admission import SHEDDABLE_RANK, Ticket
from routing.fleet.snapshot import ServedModelInfo, build_snapshot
from routing.state import RouterConfig, RouterState
from routing.telemetry.admission_metrics import admission_families, priority_families
from tests.support.metrics import Samples, families_page, value


def first(candidates: Any) -> Any:
    return candidates[0]


def test_a_saturated_model_shows_its_waiting_admitted_and_shed() -> None:
    async def scenario() -> Samples:
        state = RouterState(RouterConfig(max_inflight_per_worker=1, queue_timeout=30))
        state.install(build_snapshot(workers=[worker_view(1)], served_models=[ServedModelInfo("m")],
                                     generation=1))  # fmt: skip
        workers, admission = state.snapshot.routes["m"].workers, state.admission
        assert await admission.acquire("m", workers, None, first, state.inflight) is not None
        state.inflight[1] += 1
        shed = Ticket(rank=SHEDDABLE_RANK)
        assert await admission.acquire("m", workers, None, first, state.inflight, shed) is None
        waiting = asyncio.create_task(admission.acquire("m", workers, None, first, state.inflight))
        while not admission.queued():
            await asyncio.sleep(0)
        state.metrics.priority_capped[1] += 2
        state.gate.budgets.refusals["day"] = 1
        page = families_page([*admission_families(state), *priority_families(state)])
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return page

    page = asyncio.run(scenario())
    assert value(page, "controlpanel_router_queued", model="m") == 1
    assert value(page, "controlpanel_router_admission_rejected_total", model="m") == 1
    assert value(page, "controlpanel_router_class_queued", model="m", **{"class": "standard"}) == 1
    assert (
        value(page, "controlpanel_router_class_admitted_total", model="m", **{"class": "standard"})
        == 1
    )
    assert (
        value(page, "controlpanel_router_class_shed_total", model="m", **{"class": "sheddable"})
        == 1
    )
    assert (
        value(page, "controlpanel_router_class_shed_total", model="m", **{"class": "standard"})
        is None
    )
    assert value(page, "controlpanel_router_priority_capped_total", **{"class": "standard"}) == 2
    assert value(page, "controlpanel_router_budget_refusals_total", period="day") == 1
