"""Usage accounting: tokens per key and model read from the workers' `usage`, in the
non-streamed body and in a stream's final chunk, summed in memory by each router and
written by its refresher; shown on /usage/ and /api/usage."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from django.contrib.auth import get_user_model

from controlpanel import keys
from controlpanel.models import ApiKey, KeyUsage
from routing.auth import TokenBucket
from routing.usage import TAIL_BYTES, UsageLedger, UsageTap, find_usage
from tests import keyed
from tests.conftest import ADMIN_HEADERS, RouterServer, StartSimulator, wait_until
from tests.keyed import add_keyed_worker, bearer, issue, openai_client

keyed_router = keyed.keyed_router  # the fixture
CHAT = {"model": "m", "messages": [{"role": "user", "content": "one two three"}]}


# --- parsing, without a server ----------------------------------------------------------------


def test_usage_is_found_in_bodies_and_final_stream_events() -> None:
    body = orjson.dumps(
        {
            "choices": [{"message": {"content": 'a "usage": {"prompt_tokens": 999} trap'}}],
            "usage": {
                "prompt_tokens": 7,
                "completion_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 2},
            },
            "prompt_logprobs": None,
        }
    )
    assert find_usage(body) == (7, 5)
    stream = (
        b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"total_tokens":9,'
        b'"completion_tokens":6}}\n\ndata: [DONE]\n\n'
    )
    assert find_usage(stream) == (3, 6)
    assert find_usage(b'{"data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}') == (4, 0)
    assert find_usage(b'{"usage":{"input_tokens":2,"output_tokens":8}}') == (2, 8)
    for nothing in (b"data: [DONE]\n\n", b'{"usage": null}', b'{"usage":{"prompt_tokens":', b""):
        assert find_usage(nothing) is None


def _tap_run(chunks: list[bytes], headers: list[tuple[bytes, bytes]], status: int = 200) -> (
    tuple[UsageLedger, list[int], list[dict[str, Any]]]
):  # fmt: skip
    ledger, charged, sent = UsageLedger(), [], []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        tapped = UsageTap(ledger, 1, "m", charged.append).wrap(send)
        await tapped({"type": "http.response.start", "status": status, "headers": headers})
        for i, chunk in enumerate(chunks):
            more = i < len(chunks) - 1
            await tapped({"type": "http.response.body", "body": chunk, "more_body": more})

    asyncio.run(run())
    return ledger, charged, sent


def test_the_tap_relays_every_message_and_reads_usage_split_across_chunks() -> None:
    event = b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":22}}\n\n'
    filler = [b"data: " + b"x" * 1000 + b"\n\n"] * (3 * TAIL_BYTES // 1000)
    chunks = [*filler, event[:30], event[30:], b"data: [DONE]\n\n"]
    sse = [(b"content-type", b"text/event-stream")]
    ledger, charged, sent = _tap_run(chunks, sse)
    assert [m.get("body") for m in sent[1:]] == chunks
    assert ledger.take() == {(1, "m"): (1, 11, 22)} and charged == [33]
    # Compressed or failed answers are passed through without reading.
    ledger, charged, _ = _tap_run([event], [*sse, (b"content-encoding", b"gzip")])
    assert ledger.take() == {(1, "m"): (1, 0, 0)} and charged == []
    ledger, charged, _ = _tap_run([b'{"error":{},"usage":{"prompt_tokens":1}}'], sse, 400)
    assert not ledger and charged == []


def test_the_ledger_gives_back_what_could_not_be_written() -> None:
    ledger = UsageLedger()
    ledger.count_request(1, "m")
    ledger.add_tokens(1, "m", 3, 4)
    batch = ledger.take()
    assert not ledger
    ledger.count_request(1, "m")
    ledger.restore(batch)
    assert ledger.take() == {(1, "m"): (2, 3, 4)}


def test_token_bucket_refills_at_its_rate_and_can_go_into_debt() -> None:
    bucket = TokenBucket(60, now=0.0)  # one a second
    assert bucket.take(60, now=0.0) == 0.0
    assert bucket.take(1, now=0.0) == pytest.approx(1.0)
    assert bucket.take(1, now=1.0) == 0.0
    bucket.charge(10, now=1.0)
    assert bucket.wait_until_positive(now=1.0) == pytest.approx(11.0)
    assert bucket.wait_until_positive(now=12.5) == 0.0


# --- end to end ---------------------------------------------------------------------------------


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
    list(client.chat.completions.create(**CHAT, max_tokens=5, stream=True))  # no usage sent
    completion = client.completions.create(model="m", prompt="a b", max_tokens=2)
    assert plain.usage is not None and completion.usage is not None
    key = ApiKey.objects.get(name="team")

    def recorded() -> tuple[int, int, int] | None:
        row = KeyUsage.objects.filter(api_key=key, model="m").first()
        return row and (row.requests, row.prompt_tokens, row.completion_tokens)

    # Four answered requests; the stream without include_usage brought no token counts.
    expected_prompt = plain.usage.prompt_tokens * 2 + completion.usage.prompt_tokens
    wait_until(lambda: recorded() == (4, expected_prompt, 4 + 6 + 2), timeout=6)
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
    wait_until(lambda: KeyUsage.objects.exists(), timeout=6)
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
