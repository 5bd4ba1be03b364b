"""One GPU's reading in the common shape (controlpanel.fleet.gpu), healthy unless told."""

from __future__ import annotations

from typing import Any

GIB = 1024**3


def reading(index: int = 0, **values: Any) -> dict[str, Any]:
    base = {
        "index": index,
        "uuid": f"GPU-{index}",
        "name": "NVIDIA H100 80GB HBM3",
        "util": 0.5,
        "mem_used": 70 * GIB,
        "mem_total": 80 * GIB,
        "temp": 60.0,
        "power": 300.0,
        "power_limit": 700.0,
        "ecc_errors": 0,
        "xid": 0,
    }
    return {**base, **values}
