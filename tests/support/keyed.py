"""Helpers for tests of client API keys: keys to use, and workers a keyed router lists.
The router that requires keys is the `keyed_router` fixture (tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from controlpanel.fleet import services
from controlpanel.keys import services as keys
from controlpanel.registry.models import Worker
from simulator.server import RunningSimulator
from tests.support.servers import RouterServer, wait_until


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def issue(router: RouterServer, name: str = "test-key", **options: Any) -> str:
    """A new key, once the router knows it."""
    secret = keys.api_key_create(name=name, actor="test", **options).secret
    wait_until(lambda: router.get("/v1/models", headers=bearer(secret)).status_code == 200)
    return secret


def add_keyed_worker(router: RouterServer, sim: RunningSimulator, key: str) -> Worker:
    """A worker, once the keyed router lists its model to a key that sees every model."""
    worker = services.worker_add(url=sim.url, name="", actor="test")
    model = sim.state.config.model

    def listed() -> bool:
        answer = router.get("/v1/models", headers=bearer(key))
        return answer.status_code == 200 and model in {m["id"] for m in answer.json()["data"]}

    wait_until(listed)
    return worker


def openai_client(router: RouterServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0)


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI-format error of a response, checked for shape."""
    assert response.headers["content-type"].startswith("application/json"), response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == response.status_code
    return error
