"""Prefill/decode disaggregation through the real router (routing.pd), with simulated vLLM
servers in both roles (simulator.pd: the prefill leases its blocks, the decode pulls them
over HTTP as NIXL's pull mode reads them): the official `openai` client, streamed and not;
the decode computes no prompt tokens itself; a prefill failure moves to another prefill
worker, a decode failure before the first byte to another decode worker with the same
transfer parameters; the bypass; the explanation; a client that leaves during the prefill
leg; and the router's P/D series."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN = {"Authorization": f"Bearer {settings.CONTROLPANEL_ADMIN_TOKEN}"}
LONG = "the quick brown fox jumps over the lazy dog " * 60  # about 600 tokens: never bypassed


def api(router: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{router.url}/api{path}", headers=ADMIN, timeout=15, **kwargs)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a series' samples on a /metrics page whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def fleet(router: Any, roles: dict[str, str], model: str, bypass: int = 256) -> dict[str, int]:
    """Workers by URL with their roles, the model's bypass threshold; routable when done."""
    ids = {}
    for url, role in roles.items():
        made = api(router, "POST", "/workers", json={"url": url, "role": role, "kv_events": ""})
        assert made.status_code == 201, made.text
        ids[url] = made.json()["id"]
    assert api(router, "PATCH", f"/models/{model}", json={"pd_bypass_tokens": bypass}).is_success
    router.wait_snapshot()
    router.wait_for(lambda seen: all(i in seen and seen[i]["routable"] for i in ids.values()))
    return ids


def test_chat_and_completions_stream_through_a_prefill_and_a_decode_worker(
    router: Any, simulator: Callable[..., Any]
) -> None:
    prefill, decode = simulator("pd-a", role="prefill"), simulator("pd-a", role="decode")
    fleet(router, {prefill.url: "prefill", decode.url: "decode"}, "pd-a")
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    whole = client.chat.completions.create(
        model="pd-a", messages=[{"role": "user", "content": LONG}], max_tokens=8
    )
    assert whole.choices[0].message.content and whole.usage is not None
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 256
    streamed = client.completions.create(model="pd-a", prompt=LONG, max_tokens=6, stream=True)
    chunks = [c.choices[0].text for c in streamed if c.choices]
    assert "".join(chunks)
    # Both prompts were computed on the prefill worker and reached the decode by transfer.
    transferred = metric(
        decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    assert transferred > 2 * 256
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert prefill.state.received == 2 and decode.state.received == 2
    assert metric(router.url, "controlpanel_router_pd_transfers_total", model="pd-a") == 2
    assert metric(router.url, "controlpanel_router_pd_prefill_seconds_count", model="pd-a") == 2


def test_a_short_prompt_bypasses_the_prefill_leg(
    router: Any, simulator: Callable[..., Any]
) -> None:
    prefill, decode = simulator("pd-b", role="prefill"), simulator("pd-b", role="decode")
    fleet(router, {prefill.url: "prefill", decode.url: "decode"}, "pd-b")
    answer = router.post("/v1/chat/completions", json={
        "model": "pd-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
    })  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert prefill.state.received == 0 and decode.state.received == 1
    bypassed = metric(router.url, "controlpanel_router_pd_bypasses_total", model="pd-b")
    assert bypassed == 1


def test_a_failed_prefill_moves_to_another_prefill_worker_and_explains_both_choices(
    router: Any, simulator: Callable[..., Any], sim_loop: Any
) -> None:
    gone, prefill = simulator("pd-c", role="prefill"), simulator("pd-c", role="prefill")
    decode = simulator("pd-c", role="decode")
    fleet(router, {gone.url: "prefill", prefill.url: "prefill", decode.url: "decode"}, "pd-c")
    sim_loop.run(gone.stop())  # still routable (no probes here): connections are refused
    explained = 0
    for _ in range(6):  # the dead worker is tried first in some of them
        answer = router.post(
            "/v1/completions",
            json={"model": "pd-c", "prompt": LONG, "max_tokens": 2},
            headers={"X-Route-Explain": "1"},
        )
        assert answer.status_code == 200, answer.text
        if "x-route-explain" in answer.headers:
            told = httpx.Response(200, content=answer.headers["x-route-explain"]).json()
            assert told["prefill"]["worker"] and told["policy"] == "pd_decode"
            explained += 1
    assert explained == 6
    assert prefill.state.received == 6 and decode.state.received == 6
    failed = metric(router.url, "controlpanel_router_pd_prefill_failures_total", model="pd-c")
    assert failed >= 1  # the dead worker was tried (and ejected after enough failures)


def test_a_decode_failure_before_the_first_byte_retries_with_the_same_transfer(
    router: Any, simulator: Callable[..., Any], sim_loop: Any
) -> None:
    prefill, gone = simulator("pd-d", role="prefill"), simulator("pd-d", role="decode")
    decode = simulator("pd-d", role="decode")
    fleet(router, {prefill.url: "prefill", gone.url: "decode", decode.url: "decode"}, "pd-d")
    sim_loop.run(gone.stop())
    retried = metric(router.url, "controlpanel_router_retries_total", reason="connect")
    for _ in range(8):  # ties between the two decode workers are broken at random
        answer = router.post(
            "/v1/completions", json={"model": "pd-d", "prompt": LONG, "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text
    # One prefill leg per request, whichever decode worker the first attempt met.
    assert prefill.state.received == 8 and decode.state.received == 8
    assert metric(router.url, "controlpanel_router_retries_total", reason="connect") > retried
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0


def test_a_client_that_leaves_during_the_prefill_leg_cancels_it(
    router: Any, simulator: Callable[..., Any]
) -> None:
    prefill = simulator("pd-e", role="prefill", ttft_ms=20_000)  # a prefill that takes 20 s
    decode = simulator("pd-e", role="decode")
    fleet(router, {prefill.url: "prefill", decode.url: "decode"}, "pd-e")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{router.url}/v1/completions",
            json={"model": "pd-e", "prompt": LONG, "max_tokens": 2},
            timeout=httpx.Timeout(10, read=1.0),
        )
    # The router cancels the prefill leg; the simulator sees its request aborted.
    deadline = time.monotonic() + 30
    while prefill.state.running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert prefill.state.running == 0
    assert decode.state.received == 0


def test_an_alias_of_a_disaggregated_model_prefills_under_the_models_name(
    router: Any, simulator: Callable[..., Any]
) -> None:
    """The prefill leg names the model the alias resolved to (the prefill worker serves no
    model called like the alias), and the answer is named back to the alias."""
    prefill, decode = simulator("pd-f", role="prefill"), simulator("pd-f", role="decode")
    fleet(router, {prefill.url: "prefill", decode.url: "decode"}, "pd-f")
    made = api(router, "POST", "/aliases", json={"name": "pd-chat", "targets": {"pd-f": 1}})
    assert made.status_code == 201, made.text
    router.wait_snapshot()
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(model="pd-chat", prompt=LONG, max_tokens=3)
    assert answer.model == "pd-chat" and answer.choices[0].text
    assert prefill.state.received == 1 and decode.state.received == 1
    assert metric(router.url, "controlpanel_router_pd_transfers_total", model="pd-f") == 1
