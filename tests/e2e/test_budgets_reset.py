"""A token budget resets at the next UTC day and month, through the real router: the ASGI
app served by uvicorn on a real socket in this process (so the test can move its budget
clock to the next day), a simulated vLLM worker, and the official `openai` client."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
import openai
import pytest
import uvicorn

from routing.admission.auth import key_digest, new_key
from routing.fleet.client_keys import ClientKey
from routing.fleet.snapshot import ModelEntry, WorkerView, build_snapshot
from routing.router import RouterApp
from routing.state import RouterConfig
from tests.support.servers import StartSimulator, free_port, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 3}


class Clock:
    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


@dataclass
class InProcessRouter:
    url: str
    app: RouterApp
    clock: Clock

    def chat(self, secret: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {secret}"}
        return httpx.post(f"{self.url}/v1/chat/completions", json=CHAT, headers=headers)

    def install_key(self, key: ClientKey, worker: WorkerView) -> None:
        self.app.install(
            build_snapshot(workers=(worker,), served_models=(), generation=2, api_keys=(key,))
        )


@contextmanager
def serve(app: RouterApp) -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def in_process_router() -> Iterator[InProcessRouter]:
    clock = Clock(datetime(2026, 12, 30, 23, 59, 0, tzinfo=UTC))
    app = RouterApp(RouterConfig(require_api_key=True))
    app.gate.budgets.now = clock
    with serve(app) as url:
        yield InProcessRouter(url, app, clock)


def worker_at(url: str) -> WorkerView:
    return WorkerView(
        id=1, name="sim", url=url, state="active", source="operator",
        models=(ModelEntry(id="m"),), queue_length=None, last_heartbeat=None, routable=True,
    )  # fmt: skip


def test_a_used_up_key_is_let_in_again_at_the_next_day_and_the_next_month(
    in_process_router: InProcessRouter, simulator: StartSimulator
) -> None:
    router, clock = in_process_router, in_process_router.clock
    worker = worker_at(simulator("m").url)
    probe_secret = new_key()
    probe = ClientKey(id=9, name="probe", prefix=probe_secret[:12], digest=key_digest(probe_secret))
    router.install_key(probe, worker)
    answer = router.chat(probe_secret)
    assert answer.status_code == 200, answer.text
    per_chat: int = answer.json()["usage"]["total_tokens"]

    secret = new_key()
    key = ClientKey(
        id=1, name="k", prefix=secret[:12], digest=key_digest(secret),
        daily_tokens=2 * per_chat, monthly_tokens=3 * per_chat,
    )  # fmt: skip
    router.install_key(key, worker)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=secret, max_retries=0)
    for _ in range(2):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "one two three"}], max_tokens=3
        )
    refused = router.chat(secret)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "60"  # 23:59:00 -> midnight
    assert "Daily token budget" in refused.text and "2026-12-31T00:00:00Z" in refused.text

    clock.at = datetime(2026, 12, 31, 0, 0, 0, tzinfo=UTC)  # the next day: the daily resets
    assert router.chat(secret).status_code == 200
    refused = router.chat(secret)  # 3 chats this month: the monthly budget is used up
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == str(24 * 3600)
    message = refused.json()["error"]["message"]
    assert message == (
        f"Monthly token budget of {3 * per_chat} tokens for key {key.prefix} is used up "
        f"({3 * per_chat} used); it resets at 2027-01-01T00:00:00Z."
    )

    clock.at = datetime(2027, 1, 1, 0, 0, 1, tzinfo=UTC)  # a new month
    assert router.chat(secret).status_code == 200
