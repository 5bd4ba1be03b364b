"""Every error the router produces comes as OpenAI-format JSON with the right status."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from controlpanel.registry.models import RoutingGeneration, Worker
from tests.support.fake_workers import fake_worker
from tests.support.servers import AddWorker, RouterServer, StartSimulator, free_port, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    return error  # type: ignore[no-any-return]


def chat(router: RouterServer, model: str = "m", **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return router.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"",
        b"[1, 2]",
        b'"text"',
        b'{"messages": []}',
        b'{"model": 42}',
        b'{"model": ""}',
    ],
)
def test_bad_bodies_get_400(router: RouterServer, body: bytes) -> None:
    response = router.post("/v1/chat/completions", content=body)
    error = assert_openai_error(response, 400)
    assert error["type"] == "BadRequestError"


def test_unknown_model_gets_404(router: RouterServer) -> None:
    error = assert_openai_error(chat(router, "no-such-model"), 404)
    assert error["type"] == "NotFoundError" and error["param"] == "model"


def test_openai_client_sees_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="absent", messages=[{"role": "user", "content": "x"}])


def test_known_model_without_routable_worker_gets_503(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    worker = add_worker(simulator("m"))
    Worker.objects.filter(pk=worker.pk).update(state="drained")
    RoutingGeneration.bump()
    router.wait_for(lambda seen: seen[worker.pk]["routable"] is False)
    response = chat(router)
    assert_openai_error(response, 503)
    assert int(response.headers["retry-after"]) > 0


def test_connection_refused_gets_502(router: RouterServer) -> None:
    worker = fake_worker(f"http://127.0.0.1:{free_port()}")
    router.wait_routable(worker)
    assert_openai_error(chat(router), 502)


def test_reset_before_response_gets_502(router: RouterServer, resetting_server: str) -> None:
    worker = fake_worker(resetting_server)
    router.wait_routable(worker)
    assert_openai_error(chat(router), 502)


def test_upstream_timeout_before_first_byte_gets_504(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    add_worker(simulator("m"))
    # The test router's first-byte limit is 3 s (tests/settings.py).
    response = router.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        headers={"X-Sim-Delay-Ms": "5000"},
    )
    assert_openai_error(response, 504)


def test_body_over_limit_gets_413(router: RouterServer) -> None:
    big = b'{"model": "m", "prompt": "' + b"x" * (1024 * 1024) + b'"}'
    assert_openai_error(router.post("/v1/completions", content=big), 413)


def test_body_over_limit_without_content_length_gets_413(router: RouterServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", "prompt": "'
        for _ in range(20):
            yield b"x" * 65536
        yield b'"}'

    assert_openai_error(router.post("/v1/completions", content=chunks()), 413)


def test_wrong_method_and_unknown_path(router: RouterServer) -> None:
    assert_openai_error(router.get("/v1/chat/completions"), 405)
    assert_openai_error(router.post("/v1/models"), 405)
    assert_openai_error(router.get("/v1/nothing-here"), 404)


def test_upstream_error_status_is_relayed_as_sent(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    sim = simulator("m")
    add_worker(sim)
    response = chat(router, max_tokens=0)
    error = assert_openai_error(response, 400)
    assert error["param"] == "max_tokens"  # the simulator's own words, untouched


@pytest.mark.parametrize(
    "path",
    [
        "/sleep",
        "/wake_up",
        "/reset_prefix_cache",
        "/collective_rpc",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    ],
)
def test_vllm_admin_endpoints_are_never_forwarded(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker, path: str
) -> None:
    sim = simulator("m")
    add_worker(sim)
    response = router.post(path, json={"model": "m", "lora_name": "x", "lora_path": "/x"})
    assert response.status_code in (404, 405)
    assert response.json()["error"]["code"] == response.status_code
    assert not [r for r in sim.state.requests if r["path"] == path]


def test_failed_requests_take_a_dead_worker_out_of_rotation(router: RouterServer) -> None:
    worker = fake_worker(f"http://127.0.0.1:{free_port()}")
    router.wait_routable(worker)
    for _ in range(3):  # CONTROLPANEL_UNHEALTHY_AFTER in a row, on real traffic
        assert_openai_error(chat(router), 502)
    router.wait_for(lambda seen: seen[worker.pk]["state"] == "unhealthy")
    worker.refresh_from_db()
    assert "connect" in worker.last_error or "refused" in worker.last_error.lower()
    assert_openai_error(chat(router), 503)  # out of the rotation: no more doomed tries


def test_error_rate_on_the_dashboard_comes_from_real_traffic(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    from controlpanel.console import dashboard

    good = add_worker(simulator("m"))
    bad = fake_worker(f"http://127.0.0.1:{free_port()}")
    router.wait_routable(bad)
    Worker.objects.filter(pk=good.pk).update(state="drained")
    RoutingGeneration.bump()
    router.wait_for(lambda seen: not seen[good.pk]["routable"])
    assert_openai_error(chat(router), 502)  # one failure: still below the unhealthy mark
    Worker.objects.filter(pk=good.pk).update(state="active")
    Worker.objects.filter(pk=bad.pk).update(state="drained")
    RoutingGeneration.bump()
    router.wait_for(lambda seen: seen[good.pk]["routable"] and not seen[bad.pk]["routable"])
    for _ in range(4):
        assert chat(router).status_code == 200

    def rates() -> dict[int, object]:
        return {row.worker.pk: row.metrics["error_rate"] for row in dashboard.fleet_rows()}

    wait_until(lambda: rates() == {good.pk: 0.0, bad.pk: 1.0})
