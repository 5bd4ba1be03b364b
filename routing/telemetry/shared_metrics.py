"""/metrics for the routing state shared between routers (routing.peers.fleet_sync and
routing.peers.load_push): whether it is shared now, with how many peers, at what cost."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from routing.peers.fleet_sync import FleetSync


def shared_state_families(sync: FleetSync | None) -> Iterator[Metric]:
    """/metrics: whether routing state is shared now, with how many peers, at what cost."""
    up = GaugeMetricFamily(
        "controlpanel_router_shared_state_up",
        "1 while this router shares routing state through Redis, 0 while it falls back to "
        "its own (Redis down); absent without Redis.",
    )
    if sync is None:
        return
    up.add_metric([], 1 if sync.up else 0)
    yield up
    peers = GaugeMetricFamily(
        "controlpanel_router_shared_peers", "Other live routers of the deployment seen."
    )
    peers.add_metric([], sync.peers)
    yield peers
    moved = CounterMetricFamily(
        "controlpanel_router_shared_bytes",
        "Bytes of shared routing state this router wrote to and read from Redis.",
        labels=["direction"],
    )
    moved.add_metric(["out"], sync.bytes_out + sync.push.bytes_out)
    moved.add_metric(["in"], sync.bytes_in + sync.push.bytes_in)
    yield moved
    pushes = CounterMetricFamily(
        "controlpanel_router_shared_load_pushes",
        "In-flight count changes pushed between sync ticks (routing.peers.load_push): messages "
        "this router sent, peers' messages it applied, malformed ones it ignored, and "
        "sends that failed.",
        labels=["direction"],
    )
    pushes.add_metric(["out"], sync.push.sent)
    pushes.add_metric(["in"], sync.push.received)
    pushes.add_metric(["malformed"], sync.push.malformed)
    pushes.add_metric(["failed"], sync.push.errors)
    yield pushes
    credits = CounterMetricFamily(
        "controlpanel_router_shared_prefix_credits",
        "Prompts other routers routed that this router's prefix index took in.",
    )
    credits.add_metric([], sync.credits_applied)
    yield credits
    leases = GaugeMetricFamily(
        "controlpanel_router_lease_slots",
        "This router's lease on each fleet-wide in-flight limit (routing.admission.leases): "
        "the slots "
        "of `limit` (worker:<id> or model:<name>) it may fill now.",
        labels=["limit"],
    )
    for key, slots in sorted(sync.router.admission.leases.granted.items()):
        leases.add_metric([key], slots)
    yield leases
