"""Client API keys, end to end: a router started with CONTROLPANEL_REQUIRE_API_KEY=1, keys
made through the admin API, the command and the service, and the official OpenAI client."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import ApiKey, Event
from tests.support.common import ADMIN_HEADERS, ROOT
from tests.support.keyed import add_keyed_worker, bearer, error_of, issue, openai_client
from tests.support.servers import RouterServer, StartSimulator, subprocess_env, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_without_a_key_every_model_route_answers_401_in_openai_format(
    keyed_router: RouterServer,
) -> None:
    for method, path in [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/tokenize"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/m"),
        ("GET", "/list_models"),
        ("GET", "/list_workers"),
        ("GET", "/v1/unknown"),
    ]:
        response = httpx.request(method, keyed_router.url + path, json=CHAT, timeout=10)
        assert response.status_code == 401, (path, response.text)
        error = error_of(response)
        assert error["type"] == "AuthenticationError"
        assert "Authorization: Bearer" in error["message"]
    # Load balancers and Prometheus need no key.
    assert keyed_router.get("/health").status_code == 200
    assert keyed_router.get("/metrics").status_code == 200


def test_a_wrong_or_malformed_key_is_refused(keyed_router: RouterServer) -> None:
    real = issue(keyed_router)
    wrong = real[:-4] + ("aaaa" if not real.endswith("aaaa") else "bbbb")
    for header in (f"Bearer {wrong}", "Bearer cpk_nothing", "Basic dXNlcjpwYXNz", "Bearer", "x"):
        response = keyed_router.post(
            "/v1/chat/completions", json=CHAT, headers={"Authorization": header}
        )
        assert response.status_code == 401, header
        assert wrong not in error_of(response)["message"]  # a wrong key is masked
    with pytest.raises(openai.AuthenticationError):
        openai_client(keyed_router, wrong).chat.completions.create(**CHAT)


def test_api_key_from_the_admin_api_works_with_the_openai_client(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    created = keyed_router.post(
        "/api/keys", json={"name": "search-team", "rpm": 600}, headers=ADMIN_HEADERS
    )
    assert created.status_code == 201, created.text
    body = created.json()
    secret = body["key"]
    assert secret.startswith(body["prefix"]) and body["models"] == [] and body["rpm"] == 600
    record = ApiKey.objects.get(pk=body["id"])
    assert record.key_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in str(ApiKey.objects.filter(pk=record.pk).values().first())
    listed = keyed_router.get("/api/keys", headers=ADMIN_HEADERS).json()
    assert [k["prefix"] for k in listed] == [body["prefix"]] and "key" not in listed[0]

    sim = simulator("m")
    add_keyed_worker(keyed_router, sim, secret)
    client = openai_client(keyed_router, secret)
    answer = client.chat.completions.create(**CHAT)
    assert answer.choices[0].message.content
    chunks = list(client.chat.completions.create(**CHAT, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    assert client.models.retrieve("m").id == "m"
    # The client's key never reaches a worker.
    forwarded = [r for r in sim.state.requests if r["path"] == "/v1/chat/completions"]
    assert len(forwarded) == 2
    assert all("authorization" not in {h.lower() for h in r["headers"]} for r in forwarded)


def test_a_key_limited_to_some_models_gets_404_for_others(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    everything = issue(keyed_router, "all")
    add_keyed_worker(keyed_router, simulator("m"), everything)
    add_keyed_worker(keyed_router, simulator("other"), everything)
    limited = issue(keyed_router, "limited", models=["m"])
    client = openai_client(keyed_router, limited)
    assert client.chat.completions.create(**CHAT).model == "m"
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(**{**CHAT, "model": "other"})
    assert "does not exist or you do not have access to it" in str(refused.value)
    # The same answer as for a model nobody serves: a limited key learns nothing.
    unknown = keyed_router.post(
        "/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=bearer(limited)
    )
    other = keyed_router.post(
        "/v1/chat/completions", json={**CHAT, "model": "other"}, headers=bearer(limited)
    )
    assert other.status_code == 404 and error_of(other)["param"] == "model"
    assert unknown.status_code == 404
    assert [m.id for m in client.models.list().data] == ["m"]
    assert keyed_router.get("/v1/models/other", headers=bearer(limited)).status_code == 404
    assert {m.id for m in openai_client(keyed_router, everything).models.list().data} == {
        "m",
        "other",
    }


def test_requests_per_minute_answer_429_with_retry_after(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    everything = issue(keyed_router, "all")
    add_keyed_worker(keyed_router, simulator("m"), everything)
    slow = issue(keyed_router, "slow", rpm=2)
    statuses = [
        keyed_router.post("/v1/chat/completions", json=CHAT, headers=bearer(slow)) for _ in range(3)
    ]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    error = error_of(statuses[-1])
    assert error["type"] == "RateLimitError" and "requests per minute (2)" in error["message"]
    assert 1 <= int(statuses[-1].headers["retry-after"]) <= 30
    with pytest.raises(openai.RateLimitError):
        openai_client(keyed_router, slow).chat.completions.create(**CHAT)
    # Other keys have their own buckets.
    ok = keyed_router.post("/v1/chat/completions", json=CHAT, headers=bearer(everything))
    assert ok.status_code == 200


def test_tokens_per_minute_hold_a_key_once_its_usage_is_spent(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    everything = issue(keyed_router, "all")
    add_keyed_worker(keyed_router, simulator("m"), everything)
    frugal = issue(keyed_router, "frugal", tpm=30)
    big = {**CHAT, "max_tokens": 40}  # more than the whole minute's tokens at once
    first = keyed_router.post("/v1/chat/completions", json=big, headers=bearer(frugal))
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] > 30
    second = keyed_router.post("/v1/chat/completions", json=CHAT, headers=bearer(frugal))
    assert second.status_code == 429
    assert "tokens per minute (30)" in error_of(second)["message"]
    assert int(second.headers["retry-after"]) >= 1


def test_a_revoked_key_is_refused_within_a_second(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    created = keyed_router.post("/api/keys", json={"name": "temp"}, headers=ADMIN_HEADERS).json()
    secret = created["key"]
    add_keyed_worker(keyed_router, simulator("m"), secret)
    assert keyed_router.post("/v1/chat/completions", json=CHAT, headers=bearer(secret)).is_success
    revoked = httpx.delete(f"{keyed_router.url}/api/keys/{created['id']}", headers=ADMIN_HEADERS)
    assert revoked.status_code == 204
    wait_until(
        lambda: (
            keyed_router.post("/v1/chat/completions", json=CHAT, headers=bearer(secret)).status_code
            == 401
        ),
    )
    assert keyed_router.get("/api/keys", headers=ADMIN_HEADERS).json()[0]["revoked_at"]
    missing = httpx.delete(f"{keyed_router.url}/api/keys/999999", headers=ADMIN_HEADERS)
    assert missing.status_code == 404 and error_of(missing)["type"] == "KeyNotFound"
    # Both ends of the key's life are in the audit trail, by prefix, never with the secret.
    trail = Event.objects.filter(kind__in=[EventKind.API_KEY_CREATED, EventKind.API_KEY_REVOKED])
    assert [e.kind for e in trail.order_by("id")] == ["api_key_created", "api_key_revoked"]
    assert all(created["prefix"] in e.message and secret not in str(e.as_dict()) for e in trail)
    assert all(e.actor for e in trail)


def test_the_key_api_validates_and_needs_an_admin(keyed_router: RouterServer) -> None:
    url = f"{keyed_router.url}/api/keys"
    assert httpx.post(url, json={"name": "x"}).status_code == 401
    assert httpx.get(url).status_code == 401
    assert httpx.delete(f"{url}/1").status_code == 401
    for bad in ({"name": ""}, {"name": "x", "rpm": 0}, {"name": "x", "tpm": -5}, {"rpm": 3}):
        response = httpx.post(url, json=bad, headers=ADMIN_HEADERS)
        assert response.status_code == 422, bad
        assert error_of(response)["type"] == "ValidationError"
    assert not ApiKey.objects.exists()


def test_create_api_key_command_prints_a_working_key_once(
    keyed_router: RouterServer, var_dir: Path
) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "create_api_key",
            "ci",
            "--models",
            "m, chat",
            "--rpm",
            "5",
            "--allow-unknown-models",
        ],
        cwd=ROOT,
        env=subprocess_env(var_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    secret = result.stdout.strip()
    assert secret.startswith("cpk_") and len(secret) == 55
    assert "shown only now" in result.stderr and secret not in result.stderr
    record = ApiKey.objects.get(name="ci")
    assert record.allowed_models == ["chat", "m"] and record.rpm == 5
    wait_until(lambda: keyed_router.get("/v1/models", headers=bearer(secret)).status_code == 200)
    bad = subprocess.run(
        [sys.executable, "manage.py", "create_api_key", "x", "--rpm", "0"],
        cwd=ROOT,
        env=subprocess_env(var_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "rpm must be at least 1" in bad.stderr
