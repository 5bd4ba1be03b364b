"""The suite's own way to start a router on a port: ports out of the kernel's ephemeral
range, and a start that only counts the router's own answer. CI once ran a module's keyed
router on a port another server held: /health was answered for it, and then every request
of the module was refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.servers import (
    StartSimulator,
    free_port,
    free_ports,
    start_router,
    stop_process,
)


def ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_free_ports_lie_below_the_ephemeral_range_and_are_not_handed_out_twice() -> None:
    picked = [free_port() for _ in range(200)] + free_ports(50)
    assert len(set(picked)) == len(picked)
    assert max(picked) < ephemeral_range()[0]


def test_a_router_whose_port_another_server_holds_fails_to_start(
    tmp_path: Path, simulator: StartSimulator
) -> None:
    squatter = simulator("m")  # answers /health 200, as a router would
    # A database of its own: the router never gets to serve, and touches no test's rows.
    alone = f"sqlite:///{tmp_path / 'alone.sqlite3'}"
    try:
        started = start_router(tmp_path, port=squatter.port, DATABASE_URL=alone)
    except AssertionError as exc:
        assert "router exited early" in str(exc)
        assert "address already in use" in str(exc)
        return
    stop_process(started.proc)  # it would bind the port once the simulator is gone
    pytest.fail("start_router returned a router that another server answered for")
