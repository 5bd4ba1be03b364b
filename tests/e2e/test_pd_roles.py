"""Prefill/decode roles in the control plane (issue #28): a worker's `role` and a model's
`pd_bypass_tokens` through the services, the admin API, the agent and its command, the
routing snapshot, the router's /list_workers, and a disaggregated request through the real
router: a fake prefill worker (one that answers with vLLM's `kv_transfer_params`) takes
the prefill leg and a simulated vLLM server the decode leg.

Everything runs against the session's router (uvicorn in a subprocess, the admin API and
the pages in it) on real sockets; the module imports no other test module, so it can move
as it is."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from controlpanel.fleet import served_models, services
from controlpanel.fleet.agent import Agent
from controlpanel.fleet.errors import InvalidModelSetting, InvalidWorkerRole
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Event, ServedModel, Worker
from controlpanel.routers.snapshot import routing_snapshot_build

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN = {"Authorization": f"Bearer {settings.CONTROLPANEL_ADMIN_TOKEN}"}
AGENT_TOKEN = settings.CONTROLPANEL_WORKER_TOKEN
TRANSFER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-engine-1",
    "remote_block_ids": [1, 2, 3],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
}


def api(router: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{router.url}/api{path}", headers=ADMIN, timeout=15, **kwargs)


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The API's error shape (OpenAI's): {"error": {"message", "type", "param", "code"}}."""
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == response.status_code
    return error


def chat(router: Any, model: str, text: str = "hi") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return router.post("/v1/chat/completions", json=body)


@pytest.fixture
def prefill_server(sim_loop: Any) -> Iterator[Callable[[str], tuple[str, list[dict[str, Any]]]]]:
    """A worker that lists `model` and answers a prefill leg as vLLM's kv_producer does (one
    token, and the `kv_transfer_params` a decode worker pulls the blocks with); returns its
    URL and the bodies it was sent."""
    runners: list[web.AppRunner] = []

    async def start(model: str) -> tuple[str, list[dict[str, Any]]]:
        seen: list[dict[str, Any]] = []

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": model}]})

        async def prefill(request: web.Request) -> web.Response:
            seen.append(await request.json())
            return web.json_response({
                "id": "chatcmpl-prefill", "object": "chat.completion", "model": model,
                "choices": [{"index": 0, "finish_reason": "length",
                             "message": {"role": "assistant", "content": "."}}],
                "kv_transfer_params": TRANSFER,
            })  # fmt: skip

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/chat/completions", prefill)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}", seen

    yield lambda model: sim_loop.run(start(model))
    for runner in runners:
        sim_loop.run(runner.cleanup())


# -- the services ------------------------------------------------------------------------------


def test_a_worker_is_added_updated_and_registered_with_its_role(
    router: Any, simulator: Callable[..., Any]
) -> None:
    plain = services.worker_add(url=simulator("svc-model").url, actor="test")
    assert plain.role == "both"
    prefill = services.worker_add(url=simulator("svc-model").url, role="prefill", actor="test")
    assert Worker.objects.get(pk=prefill.pk).role == "prefill"
    joined = Event.objects.get(worker=prefill, kind=EventKind.WORKER_JOINED)
    assert "as a prefill worker" in joined.message
    assert joined.data["after"]["role"] == "prefill"

    services.worker_update(worker_id=plain.pk, name=None, weight=None, role="decode", actor="ops")
    assert Worker.objects.get(pk=plain.pk).role == "decode"
    changed = Event.objects.filter(worker=plain, kind=EventKind.WORKER_CHANGED).latest("pk")
    assert (changed.data["before"]["role"], changed.data["after"]["role"]) == ("both", "decode")
    # None leaves it; an agent's registration without a role keeps the operator's.
    services.worker_update(worker_id=plain.pk, name="renamed", weight=None, actor="ops")
    services.worker_register(url=plain.url, models=["svc-model"])
    assert Worker.objects.get(pk=plain.pk).role == "decode"
    services.worker_register(url=plain.url, models=["svc-model"], role="both")
    assert Worker.objects.get(pk=plain.pk).role == "both"
    fresh = services.worker_register(url=simulator("svc-model").url, models=["svc-model"])
    assert fresh.role == "both"


@pytest.mark.parametrize("bad", ["", "Prefill", "decoder", "prefill,decode", "mixed"])
def test_a_role_that_is_not_one_of_the_three_is_refused_and_changes_nothing(
    router: Any, simulator: Callable[..., Any], bad: str
) -> None:
    sim = simulator("svc-bad")
    with pytest.raises(InvalidWorkerRole, match='"prefill", "decode", "both"'):
        services.worker_add(url=sim.url, role=bad, actor="test")
    assert not Worker.objects.filter(url=sim.url).exists()
    with pytest.raises(InvalidWorkerRole):
        services.worker_register(url=sim.url, models=["svc-bad"], role=bad)
    assert not Worker.objects.filter(url=sim.url).exists()
    worker = services.worker_add(url=sim.url, role="decode", actor="test")
    with pytest.raises(InvalidWorkerRole):
        services.worker_update(worker_id=worker.pk, name="x", weight=None, role=bad, actor="t")
    assert Worker.objects.get(pk=worker.pk).role == "decode"
    assert Worker.objects.get(pk=worker.pk).name != "x"


def test_a_models_bypass_threshold_is_set_and_checked(
    router: Any, simulator: Callable[..., Any]
) -> None:
    services.worker_add(url=simulator("svc-bypass").url, actor="test")
    assert ServedModel.objects.get(name="svc-bypass").pd_bypass_tokens == 256
    served_models.served_model_set_pd_bypass(name="svc-bypass", pd_bypass_tokens=0, actor="ops")
    assert ServedModel.objects.get(name="svc-bypass").pd_bypass_tokens == 0
    event = Event.objects.filter(kind=EventKind.MODEL_CHANGED).latest("pk")
    assert event.message == "svc-bypass: pd_bypass_tokens 256 → 0"
    assert event.data["before"] == {"pd_bypass_tokens": 256}
    with pytest.raises(InvalidModelSetting, match="at least 0"):
        served_models.served_model_set_pd_bypass(
            name="svc-bypass", pd_bypass_tokens=-1, actor="ops"
        )
    assert ServedModel.objects.get(name="svc-bypass").pd_bypass_tokens == 0


# -- the admin API -----------------------------------------------------------------------------


def test_the_api_creates_patches_and_lists_a_workers_role(
    router: Any, simulator: Callable[..., Any]
) -> None:
    created = api(router, "POST", "/workers", json={"url": simulator("api-model").url,
                                                     "role": "prefill"})  # fmt: skip
    assert created.status_code == 201, created.text
    assert created.json()["role"] == "prefill"
    default = api(router, "POST", "/workers", json={"url": simulator("api-model").url})
    assert default.json()["role"] == "both"
    worker_id = created.json()["id"]

    patched = api(router, "PATCH", f"/workers/{worker_id}", json={"role": "decode"})
    assert patched.status_code == 200, patched.text
    assert patched.json()["role"] == "decode"
    assert api(router, "GET", f"/workers/{worker_id}").json()["role"] == "decode"
    listed = {w["id"]: w["role"] for w in api(router, "GET", "/workers").json()}
    assert listed == {worker_id: "decode", default.json()["id"]: "both"}
    # A PATCH without `role` leaves it.
    assert api(router, "PATCH", f"/workers/{worker_id}", json={"weight": 2}).json()["role"] == (
        "decode"
    )


def test_the_api_refuses_a_bad_role_with_its_error_shape(
    router: Any, simulator: Callable[..., Any]
) -> None:
    sim = simulator("api-bad")
    refused = api(router, "POST", "/workers", json={"url": sim.url, "role": "decoder"})
    assert refused.status_code == 422
    error = error_of(refused)
    assert "role" in error["message"] and "'prefill', 'decode' or 'both'" in error["message"]
    assert not Worker.objects.filter(url=sim.url).exists()
    worker_id = api(router, "POST", "/workers", json={"url": sim.url}).json()["id"]
    for bad in ("", "PREFILL", 3, None):
        response = api(router, "PATCH", f"/workers/{worker_id}", json={"role": bad})
        if bad is None:  # null: "leave it", like every other PATCH field
            assert response.status_code == 200 and response.json()["role"] == "both"
            continue
        assert response.status_code == 422, (bad, response.text)
        assert "role" in error_of(response)["message"]
    assert Worker.objects.get(pk=worker_id).role == "both"


def test_the_model_endpoints_show_and_set_the_bypass_threshold(
    router: Any, simulator: Callable[..., Any]
) -> None:
    services.worker_add(url=simulator("api-bypass").url, actor="test")
    assert api(router, "GET", "/models/api-bypass").json()["pd_bypass_tokens"] == 256
    patched = api(router, "PATCH", "/models/api-bypass", json={"pd_bypass_tokens": 1024})
    assert patched.status_code == 200, patched.text
    assert patched.json()["pd_bypass_tokens"] == 1024
    listed = {m["name"]: m for m in api(router, "GET", "/models").json()}
    assert listed["api-bypass"]["pd_bypass_tokens"] == 1024
    for bad in (-1, 1.5, "many", 2**31):
        response = api(router, "PATCH", "/models/api-bypass", json={"pd_bypass_tokens": bad})
        assert response.status_code == 422, (bad, response.text)
        assert "pd_bypass_tokens" in error_of(response)["message"]
    assert ServedModel.objects.get(name="api-bypass").pd_bypass_tokens == 1024
    empty = api(router, "PATCH", "/models/api-bypass", json={})
    assert empty.status_code == 422 and "pd_bypass_tokens" in error_of(empty)["message"]


# -- the agent ---------------------------------------------------------------------------------


def test_the_agent_sends_its_role_at_registration(
    router: Any, simulator: Callable[..., Any]
) -> None:
    sim = simulator("agent-model")
    agent = Agent(controller=router.url, worker_url=sim.url, token=AGENT_TOKEN, role="prefill",
                  kv_events="")  # fmt: skip
    try:
        agent.register()
        worker = Worker.objects.get(pk=agent.worker_id)
        assert worker.role == "prefill"
        assert api(router, "GET", f"/workers/{worker.pk}").json()["role"] == "prefill"
        # An operator moves it; an agent started without --role does not move it back.
        services.worker_update(worker_id=worker.pk, name=None, weight=None, role="both",
                               actor="ops")  # fmt: skip
        agent.role = None
        agent.register()
        assert Worker.objects.get(pk=worker.pk).role == "both"
    finally:
        agent.http.close()
    bad = httpx.post(f"{router.url}/api/workers/register", json={"url": sim.url, "role": "x"},
                     headers={"Authorization": f"Bearer {AGENT_TOKEN}"}, timeout=15)  # fmt: skip
    assert bad.status_code == 422
    assert error_of(bad)["type"] == "InvalidWorkerRole"
    assert Worker.objects.get(url=sim.url).role == "both"


def test_the_agent_command_takes_only_the_three_roles() -> None:
    with pytest.raises(CommandError, match="invalid choice: 'decoder'"):
        call_command("worker_agent", "--controller", "http://127.0.0.1:1",
                     "--worker-url", "http://127.0.0.1:2", "--role", "decoder")  # fmt: skip


# -- the snapshot and the router -------------------------------------------------------------


def test_the_snapshot_carries_roles_and_the_bypass_threshold(
    router: Any, simulator: Callable[..., Any]
) -> None:
    prefill = services.worker_add(url=simulator("snap-pd").url, role="prefill", actor="test")
    decode = services.worker_add(url=simulator("snap-pd").url, role="decode", actor="test")
    both = services.worker_add(url=simulator("snap-pd").url, actor="test")
    plain = services.worker_add(url=simulator("snap-plain").url, actor="test")
    served_models.served_model_set_pd_bypass(name="snap-pd", pd_bypass_tokens=64, actor="ops")
    snapshot = routing_snapshot_build()
    roles = {w.id: w.role for w in snapshot.workers}
    assert roles == {prefill.pk: "prefill", decode.pk: "decode", both.pk: "both",
                     plain.pk: "both"}  # fmt: skip
    route = snapshot.routes["snap-pd"]
    assert [w.id for w in route.prefill] == [prefill.pk]
    assert {w.id for w in route.workers} == {decode.pk, both.pk}
    assert route.pd_bypass_tokens == 64
    assert snapshot.routes["snap-plain"].prefill == ()
    assert snapshot.routes["snap-plain"].pd_bypass_tokens == 256


def test_list_workers_shows_each_workers_role_and_follows_a_change(
    router: Any, simulator: Callable[..., Any]
) -> None:
    prefill = services.worker_add(url=simulator("list-pd").url, role="prefill", actor="test")
    both = services.worker_add(url=simulator("list-pd").url, actor="test")
    router.wait_snapshot()
    seen = router.workers()
    assert (seen[prefill.pk]["role"], seen[both.pk]["role"]) == ("prefill", "both")
    api(router, "PATCH", f"/workers/{prefill.pk}", json={"role": "decode"})
    router.wait_for(lambda seen: seen[prefill.pk]["role"] == "decode")


def test_a_disaggregated_request_goes_through_the_prefill_worker_the_api_named(
    router: Any,
    simulator: Callable[..., Any],
    prefill_server: Callable[[str], tuple[str, list[dict[str, Any]]]],
) -> None:
    decode_sim = simulator("pd-e2e")
    url, prefilled = prefill_server("pd-e2e")
    made = api(router, "POST", "/workers", json={"url": url, "role": "prefill", "kv_events": ""})
    assert made.status_code == 201, made.text
    decode = api(router, "POST", "/workers", json={"url": decode_sim.url, "role": "decode"})
    ids = (made.json()["id"], decode.json()["id"])
    router.wait_for(lambda seen: all(seen[i]["routable"] for i in ids))

    # A short prompt is under the default threshold (256 tokens): straight to decode.
    short = chat(router, "pd-e2e")
    assert short.status_code == 200, short.text
    assert prefilled == [] and decode_sim.state.received == 1

    # Threshold 0: every prompt takes the prefill leg first, then the decode leg with the
    # transfer parameters the prefill worker answered.
    assert api(router, "PATCH", "/models/pd-e2e", json={"pd_bypass_tokens": 0}).status_code == 200
    router.wait_snapshot()
    answer = chat(router, "pd-e2e", "a prompt to prefill")
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    assert len(prefilled) == 1 and decode_sim.state.received == 2
    leg = prefilled[0]
    assert leg["max_tokens"] == 1 and leg["stream"] is False
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["messages"] == [{"role": "user", "content": "a prompt to prefill"}]

    # The prefill worker made "both" again: the model is no longer disaggregated, and
    # either worker takes whole requests.
    api(router, "PATCH", f"/workers/{ids[0]}", json={"role": "both"})
    router.wait_snapshot()
    for _ in range(4):
        assert chat(router, "pd-e2e", "a prompt to prefill").status_code == 200
    assert all(body["max_tokens"] == 4 for body in prefilled[1:])
    assert len(prefilled) - 1 + decode_sim.state.received - 2 == 4
