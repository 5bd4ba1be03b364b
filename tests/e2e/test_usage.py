"""Usage accounting end to end: tokens per key and model, from plain answers and streams
(the usage asked for by the router and cut out again when a keyed client did not ask),
written by the router's refresher, shown on /usage/, and held against a key's tokens per
minute; through a router that requires keys, simulated workers and the openai client."""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai
import orjson
import pytest
from django.contrib.auth import get_user_model

from controlpanel.keys import services as keys
from controlpanel.registry.models import ApiKey, KeyUsage
from tests.support.common import ADMIN_HEADERS
from tests.support.keyed import add_keyed_worker, bearer, error_of, issue, openai_client
from tests.support.servers import AddWorker, RouterServer, StartSimulator, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "one two three"}]}


@pytest.mark.django_db(transaction=True)
def test_usage_of_plain_and_streamed_answers_is_recorded_per_key_and_model(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    everything = issue(keyed_router, "ops")
    add_keyed_worker(keyed_router, simulator("m"), everything)
    team = issue(keyed_router, "team")
    client = openai_client(keyed_router, team)
    plain = client.chat.completions.create(**CHAT, max_tokens=4)
    streamed = list(
        client.chat.completions.create(
            **CHAT, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    assert streamed[-1].usage is not None
    quiet = list(client.chat.completions.create(**CHAT, max_tokens=5, stream=True))
    assert all(chunk.usage is None and chunk.choices for chunk in quiet)  # none was asked
    completion = client.completions.create(model="m", prompt="a b", max_tokens=2)
    assert plain.usage is not None and completion.usage is not None
    key = ApiKey.objects.get(name="team")

    def recorded() -> tuple[int, int, int] | None:
        row = KeyUsage.objects.filter(api_key=key, model="m").first()
        return row and (row.requests, row.prompt_tokens, row.completion_tokens)

    # Four answered requests, the stream without include_usage counted too (the router asked).
    expected_prompt = plain.usage.prompt_tokens * 3 + completion.usage.prompt_tokens
    wait_until(lambda: recorded() == (4, expected_prompt, 4 + 6 + 5 + 2))
    totals = keyed_router.get("/api/usage", headers=ADMIN_HEADERS).json()
    assert {k: v for k, v in totals[-1].items() if k in ("key_name", "model", "requests")} == {
        "key_name": "team",
        "model": "m",
        "requests": 4,
    }
    assert httpx.get(f"{keyed_router.url}/api/usage").status_code == 401


@pytest.mark.django_db(transaction=True)
def test_refused_requests_and_made_up_models_leave_no_usage(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    everything = issue(keyed_router, "ops")
    add_keyed_worker(keyed_router, simulator("m"), everything)
    for model in ("made-up-1", "made-up-2"):
        response = keyed_router.post(
            "/v1/chat/completions", json={**CHAT, "model": model}, headers=bearer(everything)
        )
        assert response.status_code == 404
    assert keyed_router.post("/v1/chat/completions", json=CHAT, headers=bearer(everything))
    wait_until(lambda: KeyUsage.objects.exists())
    assert list(KeyUsage.objects.values_list("model", "requests")) == [("m", 1)]


@pytest.mark.django_db(transaction=True)
def test_usage_page_shows_totals_per_key_and_model(keyed_router: RouterServer) -> None:
    first = keys.api_key_create(name="alpha", actor="test").record
    second = keys.api_key_create(name="beta", actor="test").record
    keys.usage_record(usage={(first.pk, "m"): (3, 30, 12), (second.pk, "chat"): (1, 5, 7)})
    keys.usage_record(usage={(first.pk, "m"): (1, 10, 4), (99999, "m"): (1, 1, 1)})
    get_user_model().objects.create_user("op", password="op-password-123", is_staff=True)
    session = httpx.Client(base_url=keyed_router.url, timeout=10)
    assert session.get("/usage/").status_code == 302  # staff only
    session.get("/admin/login/")
    session.post(
        "/admin/login/?next=/usage/",
        data={
            "username": "op",
            "password": "op-password-123",
            "csrfmiddlewaretoken": session.cookies["csrftoken"],
        },
        headers={"Referer": f"{keyed_router.url}/admin/login/"},
    )
    page = session.get("/usage/").text
    assert "alpha" in page and "beta" in page
    assert f'data-key="{first.pk}" data-model="m"' in page
    assert ">4<" in page and ">40<" in page and ">16<" in page  # 3+1 requests, 30+10, 12+4
    assert session.get("/usage/", params={"period": "nonsense"}).status_code == 200


def _sse(text: str) -> list[str]:
    assert text.endswith("\n\n"), text[-50:]
    return [event.removeprefix("data: ") for event in text.strip().split("\n\n")]


def _forwarded(sim: Any) -> dict[str, Any]:
    return [r for r in sim.state.requests if r["path"] == "/v1/chat/completions"][-1]


@pytest.mark.django_db(transaction=True)
def test_a_stream_without_include_usage_is_counted_against_tpm_and_shown_no_usage(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    everything = issue(keyed_router, "ops")
    sim = simulator("m")
    add_keyed_worker(keyed_router, sim, everything)
    frugal = issue(keyed_router, "frugal", tpm=30)
    body = orjson.dumps({**CHAT, "max_tokens": 40, "stream": True})  # past the minute's tokens
    headers = {**bearer(frugal), "Content-Type": "application/json", "X-Request-ID": "s-1"}
    streamed = keyed_router.post("/v1/chat/completions", content=body, headers=headers)
    assert streamed.status_code == 200
    events = _sse(streamed.text)
    assert events[-1] == "[DONE]" and len(events) == 1 + 40 + 1  # role, tokens, [DONE]
    assert all(orjson.loads(e)["choices"] and "usage" not in e for e in events[:-1])
    # The worker was asked for the usage; the client got its stream byte for byte without it.
    forwarded = _forwarded(sim)["body"]
    assert forwarded == body[:-1] + b',"stream_options":{"include_usage":true}}'
    direct = httpx.post(
        f"{sim.url}/v1/chat/completions",
        content=forwarded,
        headers={"X-Request-ID": "s-1", "Content-Type": "application/json"},
    )
    usage_event = _sse(direct.text)[-2]
    assert orjson.loads(usage_event)["choices"] == []
    expected = direct.text.replace(f"data: {usage_event}\n\n", "")
    assert re.sub(r'"created":\d+', "", streamed.text) == re.sub(r'"created":\d+', "", expected)

    refused = keyed_router.post("/v1/chat/completions", json=CHAT, headers=bearer(frugal))
    assert refused.status_code == 429 and "tokens per minute (30)" in error_of(refused)["message"]
    key = ApiKey.objects.get(name="frugal")
    wait_until(
        lambda: KeyUsage.objects.filter(api_key=key, model="m", completion_tokens=40).exists(),
    )


@pytest.mark.django_db(transaction=True)
def test_openai_streams_are_counted_and_asked_usage_still_reaches_the_client(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    everything = issue(keyed_router, "ops")
    sim = simulator("m")
    add_keyed_worker(keyed_router, sim, everything)
    client = openai_client(keyed_router, issue(keyed_router, "sdk", tpm=30))
    chunks = list(client.chat.completions.create(**CHAT, max_tokens=40, stream=True))
    assert chunks and all(c.usage is None and c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**CHAT, max_tokens=1)

    # A client that asks for the usage itself gets it, and its body goes on untouched.
    other = openai_client(keyed_router, issue(keyed_router, "asks"))
    asked = list(
        other.completions.create(
            model="m",
            prompt="a b",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert asked[-1].choices == [] and asked[-1].usage is not None
    assert asked[-1].usage.completion_tokens == 3
    forwarded = [r for r in sim.state.requests if r["path"] == "/v1/completions"][-1]
    assert orjson.loads(forwarded["body"])["stream_options"] == {"include_usage": True}


@pytest.mark.django_db(transaction=True)
def test_streams_without_a_key_are_not_touched(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m")
    add_worker(sim)
    body = orjson.dumps({**CHAT, "max_tokens": 3, "stream": True})
    streamed = router.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert _sse(streamed.text)[-1] == "[DONE]"
    assert _forwarded(sim)["body"] == body
