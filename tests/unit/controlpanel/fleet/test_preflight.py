"""Pool preflight's comparison (controlpanel.fleet.preflight), in process: what a worker does
not report is unknown, never a mismatch; a pool's majority is what a worker is held to."""

from __future__ import annotations

import pytest

from controlpanel.fleet import preflight

pytestmark = pytest.mark.django_db(transaction=True)


def test_what_a_worker_does_not_report_is_unknown_never_a_mismatch() -> None:
    mine = {"version": None, "max_model_len": 4096, "block_size": None, "loras": ""}
    others = [{"version": "0.11.0", "max_model_len": 4096, "block_size": "16", "loras": ""}]
    assert preflight.mismatches(mine, others) == []
    assert preflight.mismatches({"version": "0.11.0"}, [{"version": None}]) == []  # pool unknown
    assert preflight.mismatches({"version": "a"}, []) == []  # a pool of one
    votes = [{"block_size": "16"}, {"block_size": "16"}, {"block_size": "32"}]
    assert preflight.mismatches({"block_size": "32"}, votes) == [
        {"field": "block_size", "value": "32", "pool": "16"}
    ]
