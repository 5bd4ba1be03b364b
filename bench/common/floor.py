"""Starting the floor proxy (:mod:`bench.common.floor_proxy`) in a benchmark's fleet."""

from __future__ import annotations

from harness.fleet import HOST, PYTHON, Fleet


def start_floor(
    fleet: Fleet,
    port: int,
    upstreams: dict[str, list[str]],
    name: str = "floor",
    module: str = "bench.common.floor_proxy",
) -> int:
    """The floor proxy (or, as `module`, a variant of it with the same interface), with
    exactly the uvicorn flags the router gets; returns its pid."""
    spec = ";".join(f"{model}={','.join(urls)}" for model, urls in upstreams.items())
    child = fleet.spawn(
        name,
        [
            PYTHON, "-m", "uvicorn", f"{module}:app", "--host", HOST,
            "--port", str(port), "--lifespan", "on", "--no-access-log",
        ],
        extra_env={"FLOOR_UPSTREAMS": spec},
    )  # fmt: skip
    return child.pid
