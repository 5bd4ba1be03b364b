"""/metrics for prefill/decode disaggregation (routing.telemetry.pd_metrics), from a real
router's counters."""

from __future__ import annotations

from bench.common.workers import worker_view
from routing.telemetry.counters import RouterMetrics
from routing.telemetry.pd_metrics import pd_families
from tests.support.exchanges import exchange
from tests.support.metrics import families_page, value


def test_transfers_bypasses_failures_stages_and_roles() -> None:
    metrics = RouterMetrics()
    workers = [worker_view(1, role="prefill"), worker_view(2, role="decode"), worker_view(3)]
    metrics.name_workers(workers)
    metrics.pd_transfers["m"] += 2
    metrics.pd_bypasses["m", "short_prompt"] += 1
    metrics.pd_prefill_failures["m", "status_503"] += 1
    pd = {"prefill_seconds": 0.2, "prefilled_at": 10.2}
    metrics.finish(exchange(None, started=10.0, model="m", worker_id=2, status=200,
                            first_byte=10.3, pd=pd), ended=11.0)  # fmt: skip
    page = families_page(pd_families(metrics, workers))
    assert value(page, "controlpanel_router_pd_transfers_total", model="m") == 2
    assert (
        value(page, "controlpanel_router_pd_bypasses_total", model="m", reason="short_prompt") == 1
    )
    failures = "controlpanel_router_pd_prefill_failures_total"
    assert value(page, failures, model="m", reason="status_503") == 1
    assert value(page, "controlpanel_router_pd_prefill_seconds_count", model="m") == 1
    assert (
        value(page, "controlpanel_router_pd_decode_first_byte_seconds_bucket", model="m", le="0.1")
        == 0
    )
    assert (
        value(page, "controlpanel_router_pd_decode_first_byte_seconds_bucket", model="m", le="0.25")
        == 1
    )
    roles = {(dict(labels)["worker"], dict(labels)["role"]) for name, labels in page
             if name == "controlpanel_worker_role"}  # fmt: skip
    assert roles == {("w1", "prefill"), ("w2", "decode"), ("w3", "both")}
