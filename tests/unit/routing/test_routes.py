"""Which paths the router serves (routing.routes): model routes, shielded admin routes and
the listings; everything else is Django's."""

from __future__ import annotations

import pytest

from routing.routes import MODEL_ROUTES, PRIVATE_ROUTES, routes_here


@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions", "/v1/anything-new", "/tokenize", "/pooling", "/metrics",
     "/health", "/sleep", "/reset_prefix_cache", "/adapters/my-lora", "/invocations"],
)  # fmt: skip
def test_the_router_serves_model_routes_listings_and_shields_admin_ones(path: str) -> None:
    assert routes_here(path)


@pytest.mark.parametrize("path", ["/", "/api/workers", "/console/", "/static/app.js", "/v1"])
def test_everything_else_goes_to_django(path: str) -> None:
    assert not routes_here(path)


def test_no_route_is_both_forwarded_and_shielded() -> None:
    assert not MODEL_ROUTES & PRIVATE_ROUTES
    assert "/sleep" in PRIVATE_ROUTES and "/v1/completions" in MODEL_ROUTES
