"""Fallbacks end to end: the real router, simulated workers and the official client. A
request moves on to a fallback when its model has no worker or failed before the first byte,
never after it, never to a name its key may not use, and the client sees the name it asked
for; the configuration is checked, logged and shipped to the routers."""

from __future__ import annotations

import json
import re
import socket
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from controlpanel.fleet import served_models, services
from controlpanel.registry.accounts import ADMIN_TOKEN_ACTOR
from controlpanel.registry.models import Alias, Event, ServedModel
from simulator.server import RunningSimulator
from tests.support.common import ADMIN_HEADERS
from tests.support.fake_workers import fake_worker
from tests.support.keyed import bearer, issue
from tests.support.login import logged_in
from tests.support.servers import (
    AddWorker,
    RouterServer,
    StartSimulator,
    free_port,
    start_router,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)
PRIMARY, BACKUP = "fb-primary", "fb-backup"


def configure(router: RouterServer, name: str, fallbacks: list[str]) -> httpx.Response:
    """PATCH a model's fallbacks; once accepted, wait until the router routes by them."""
    answer = httpx.patch(
        f"{router.url}/api/models/{name}", json={"fallbacks": fallbacks}, headers=ADMIN_HEADERS
    )
    if answer.status_code == 200:
        router.wait_snapshot()
    return answer


def fallbacks_counted(router: RouterServer, model: str, target: str, reason: str) -> float:
    labels = f'model="{model}",reason="{reason}",target="{target}"'
    for line in router.get("/metrics").text.splitlines():
        if line.startswith(f"controlpanel_router_fallbacks_total{{{labels}}}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def access_line(router: RouterServer, request_id: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        for line in router.log().splitlines():
            if f'"request_id":"{request_id}"' in line:
                return dict(json.loads(line[line.index("{") :]))
        return None

    wait_until(lambda: found() is not None)
    line = found()
    assert line is not None
    return line


def chat(router: RouterServer, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return router.post("/v1/chat/completions", json={**body, **extra.pop("body", {})}, **extra)


@pytest.fixture
def backup_sim(simulator: StartSimulator) -> RunningSimulator:
    return simulator(BACKUP)


@pytest.fixture
def backup(simulator: StartSimulator, add_worker: AddWorker) -> RunningSimulator:
    sim = simulator(BACKUP)
    add_worker(sim, name="backup")
    return sim


def test_no_routable_worker_falls_back_and_the_client_sees_its_name(
    router: RouterServer, client: openai.OpenAI, backup: RunningSimulator
) -> None:
    ServedModel.objects.create(name=PRIMARY)  # known, served by no worker
    assert configure(router, PRIMARY, [BACKUP]).status_code == 200
    before = fallbacks_counted(router, PRIMARY, BACKUP, "no_worker")

    answer = client.chat.completions.create(
        model=PRIMARY, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert answer.model == PRIMARY and answer.choices[0].message.content
    stream = client.chat.completions.create(
        model=PRIMARY, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    chunks = list(stream)
    assert chunks and {c.model for c in chunks} == {PRIMARY}
    assert backup.state.completed == 2  # the backup answered both
    assert fallbacks_counted(router, PRIMARY, BACKUP, "no_worker") - before == 2
    # The models page shows how many moved on, from every live router's report.
    operator = logged_in(router)
    moved = re.compile(rf"moved on since the routers started: (\d+) to {re.escape(BACKUP)}")

    def page_counts_them() -> bool:
        found = moved.search(operator.get("/models/").text)
        return found is not None and int(found[1]) >= before + 2

    wait_until(page_counts_them)


def test_the_move_is_in_the_access_log_and_the_explanation(
    router: RouterServer, backup: RunningSimulator
) -> None:
    ServedModel.objects.create(name=PRIMARY)
    configure(router, PRIMARY, [BACKUP])
    rid = uuid.uuid4().hex
    answer = chat(router, PRIMARY, headers={"X-Request-ID": rid, "X-Route-Explain": "1"})
    assert answer.status_code == 200 and answer.json()["model"] == PRIMARY
    explained = json.loads(answer.headers["x-route-explain"])
    assert explained["model"] == PRIMARY and explained["target"] == BACKUP
    assert explained["fallbacks"] == [{"from": PRIMARY, "to": BACKUP, "reason": "no_worker"}]
    assert [a["worker"] for a in explained["attempts"]] == ["backup"]
    line = access_line(router, rid)
    assert line["model"] == BACKUP and line["worker"] == "backup" and line["status"] == 200
    assert line["fallbacks"] == [{"from": PRIMARY, "to": BACKUP, "reason": "no_worker"}]
    plain = uuid.uuid4().hex
    assert chat(router, BACKUP, headers={"X-Request-ID": plain}).status_code == 200
    assert access_line(router, plain)["fallbacks"] is None


def test_a_refused_connection_falls_back_after_the_retries(
    router: RouterServer, backup: RunningSimulator
) -> None:
    for _ in range(2):
        router.wait_routable(fake_worker(f"http://127.0.0.1:{free_port()}", model=PRIMARY))
    configure(router, PRIMARY, [BACKUP])
    before = fallbacks_counted(router, PRIMARY, BACKUP, "connect")
    answer = chat(router, PRIMARY)
    assert answer.status_code == 200 and answer.json()["model"] == PRIMARY
    assert backup.state.completed == 1
    assert fallbacks_counted(router, PRIMARY, BACKUP, "connect") - before == 1


@pytest.mark.parametrize("status", [429, 503])
def test_a_not_now_answer_falls_back_instead_of_being_relayed(
    router: RouterServer,
    simulator: StartSimulator,
    add_worker: AddWorker,
    backup: RunningSimulator,
    status: int,
) -> None:
    busy = simulator(PRIMARY)
    add_worker(busy, name="busy")
    httpx.post(f"{busy.url}/sim/control", json={"fail_ratio": 1, "fail_status": status})
    configure(router, PRIMARY, [BACKUP])
    answer = chat(router, PRIMARY, body={"stream": True})
    assert answer.status_code == 200, answer.text
    assert f'"model":"{PRIMARY}"' in answer.text and BACKUP not in answer.text
    assert busy.state.injected_failures == 1 and backup.state.completed == 1
    assert fallbacks_counted(router, PRIMARY, BACKUP, f"status_{status}") >= 1


def test_a_saturated_primary_falls_back_but_a_shed_request_does_not(
    tmp_path: Path, simulator: StartSimulator, backup_sim: RunningSimulator
) -> None:
    """The router's own admission refusing a request (limits full, its wait for room run
    out) moves it on; a sheddable request shed under that load gets its 429, as its class
    asks. (A wait, not an empty queue: with Redis, the first request waits for the lease.)"""
    router = start_router(tmp_path, CONTROLPANEL_QUEUE_TIMEOUT="0.5")
    try:
        slow = simulator(PRIMARY, ttft_ms=1500)  # under the tests' 3 s read timeout
        for sim in (slow, backup_sim):
            router.wait_routable(services.worker_add(url=sim.url, actor="test"))
        served_models.served_model_set_limit(name=PRIMARY, max_inflight=1, actor="test")
        configure(router, PRIMARY, [BACKUP])
        answered = backup_sim.state.completed
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(chat, router, PRIMARY)
            wait_until(lambda: slow.state.received == 1)
            moved = chat(router, PRIMARY)
            shed = chat(router, PRIMARY, headers={"X-Priority": "sheddable"})
            assert first.result().status_code == 200
        assert moved.status_code == 200, moved.text
        assert moved.json()["model"] == PRIMARY and backup_sim.state.completed == answered + 1
        assert fallbacks_counted(router, PRIMARY, BACKUP, "saturated") == 1
        assert shed.status_code == 429 and "sheddable" in shed.json()["error"]["message"]
        assert shed.headers["retry-after"]
    finally:
        stop_process(router.proc)


def test_no_response_in_time_falls_back(
    router: RouterServer,
    simulator: StartSimulator,
    add_worker: AddWorker,
    backup: RunningSimulator,
) -> None:
    slow = simulator(PRIMARY)
    add_worker(slow, name="slow")
    # Past the test router's 3 s to the response head (tests/settings.py).
    httpx.post(f"{slow.url}/sim/control", json={"extra_ttft_ms": 5000})
    configure(router, PRIMARY, [BACKUP])
    answer = chat(router, PRIMARY)
    assert answer.status_code == 200 and answer.json()["model"] == PRIMARY
    assert backup.state.completed == 1
    assert fallbacks_counted(router, PRIMARY, BACKUP, "timeout") == 1


def test_without_fallbacks_the_not_now_answer_is_relayed_as_before(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker
) -> None:
    busy = simulator(PRIMARY)
    add_worker(busy, name="busy")
    httpx.post(f"{busy.url}/sim/control", json={"fail_ratio": 1, "fail_status": 503})
    assert chat(router, PRIMARY).status_code == 503


@pytest.fixture
def breaks_mid_stream() -> Iterator[str]:
    """A worker that sends an SSE head and one event, then resets the connection."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()
    event = b'data: {"id":"x","object":"chat.completion.chunk","model":"fb-primary"}\n\n'
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.recv(65536)
            conn.sendall(head + b"%x\r\n" % len(event) + event + b"\r\n")
            threading.Event().wait(0.2)
            conn.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    server.close()


def test_a_stream_that_breaks_after_its_first_byte_does_not_fall_back(
    router: RouterServer, backup: RunningSimulator, breaks_mid_stream: str
) -> None:
    router.wait_routable(fake_worker(breaks_mid_stream, model=PRIMARY))
    configure(router, PRIMARY, [BACKUP])
    answer = chat(router, PRIMARY, body={"stream": True})
    assert answer.status_code == 200
    assert '"model":"fb-primary"' in answer.text  # the first event reached the client
    assert "failed mid-stream" in answer.text  # then the stream's honest end
    assert backup.state.received == 0
    assert fallbacks_counted(router, PRIMARY, BACKUP, "reset") == 0


def test_a_fallback_may_be_an_alias_and_an_alias_may_fall_back(
    router: RouterServer, client: openai.OpenAI, backup: RunningSimulator
) -> None:
    ServedModel.objects.create(name=PRIMARY)
    admin = {"headers": ADMIN_HEADERS}
    made = router.post("/api/aliases", json={"name": "fb-spare", "targets": {BACKUP: 1}}, **admin)
    assert made.status_code == 201, made.text
    made = router.post(
        "/api/aliases",
        json={"name": "fb-chat", "targets": {PRIMARY: 1}, "fallbacks": ["fb-spare"]},
        **admin,
    )
    assert made.status_code == 201 and made.json()["fallbacks"] == ["fb-spare"], made.text
    configure(router, PRIMARY, ["fb-spare"])
    for asked in ("fb-chat", PRIMARY):
        answer = client.chat.completions.create(
            model=asked, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        assert {c.model for c in answer} == {asked}
        assert fallbacks_counted(router, asked, "fb-spare", "no_worker") == 1
    assert backup.state.completed == 2


def test_a_key_never_falls_back_to_a_name_it_may_not_use(
    keyed_router: RouterServer,
    simulator: StartSimulator,
) -> None:
    from controlpanel.fleet import services

    sim = simulator(BACKUP)
    services.worker_add(url=sim.url, name="backup", actor="test")
    ServedModel.objects.create(name=PRIMARY)
    assert configure(keyed_router, PRIMARY, [BACKUP]).status_code == 200
    narrow = issue(keyed_router, "narrow", models=[PRIMARY], allow_unknown_models=True)
    wide = issue(keyed_router, "wide", models=[PRIMARY, BACKUP], allow_unknown_models=True)

    refused = chat(keyed_router, PRIMARY, headers=bearer(narrow))
    assert refused.status_code == 503, refused.text  # the primary's own error
    assert f"`{PRIMARY}`" in refused.json()["error"]["message"]
    assert sim.state.received == 0
    allowed = chat(keyed_router, PRIMARY, headers=bearer(wide))
    assert allowed.status_code == 200 and allowed.json()["model"] == PRIMARY
    assert sim.state.completed == 1


def test_every_fallback_failing_gives_one_clear_503(router: RouterServer) -> None:
    ServedModel.objects.create(name=PRIMARY)
    ServedModel.objects.create(name=BACKUP)
    configure(router, PRIMARY, [BACKUP])
    # Not a snapshot still holding an earlier test's (stopped) backup worker: a generation
    # compare cannot tell, since every test starts from a flushed database.
    router.wait_for(lambda seen: not seen)
    answer = chat(router, PRIMARY)
    assert answer.status_code == 503 and answer.headers["retry-after"]
    message = answer.json()["error"]["message"]
    assert message == (
        f"no worker is available for model `{PRIMARY}` or any of its fallbacks right now"
    )


def test_changes_are_logged_with_the_actor_and_before_and_after(
    router: RouterServer, backup: RunningSimulator
) -> None:
    ServedModel.objects.create(name=PRIMARY)
    configure(router, PRIMARY, [BACKUP])
    configure(router, PRIMARY, [])
    events = list(Event.objects.filter(kind="model_changed").order_by("pk"))
    assert [e.data["after"] for e in events] == [{"fallbacks": [BACKUP]}, {"fallbacks": []}]
    assert [e.data["before"] for e in events] == [{"fallbacks": []}, {"fallbacks": [BACKUP]}]
    assert {e.actor for e in events} == {ADMIN_TOKEN_ACTOR}
    assert events[0].message == f"{PRIMARY}: fallbacks (none) → {BACKUP}"
    assert ServedModel.objects.get(name=PRIMARY).fallbacks == []
    router.post("/api/aliases", json={"name": "fb-chat", "targets": {BACKUP: 1}},
                headers=ADMIN_HEADERS)  # fmt: skip
    patched = httpx.patch(f"{router.url}/api/aliases/fb-chat", json={"fallbacks": [PRIMARY]},
                          headers=ADMIN_HEADERS)  # fmt: skip
    assert patched.status_code == 200 and patched.json()["fallbacks"] == [PRIMARY]
    alias_event = Event.objects.filter(kind="alias_changed").latest("pk")
    assert alias_event.data["before"] == {"fallbacks": []}
    assert alias_event.data["after"] == {"fallbacks": [PRIMARY]}
    assert alias_event.actor == ADMIN_TOKEN_ACTOR


@pytest.mark.parametrize(
    ("fallbacks", "says"),
    [
        (["no-such-model"], "unknown fallback `no-such-model`"),
        ([PRIMARY], "cannot fall back to itself"),
        ([BACKUP, BACKUP], "named twice"),
        ([f"m{i}" for i in range(9)], "at most 8 fallbacks"),
        ([""], "a list of model or alias names"),
    ],
)
def test_bad_fallbacks_get_a_clear_422_and_change_nothing(
    router: RouterServer, backup: RunningSimulator, fallbacks: list[str], says: str
) -> None:
    ServedModel.objects.create(name=PRIMARY)
    for i in range(9):
        ServedModel.objects.create(name=f"m{i}")
    answer = configure(router, PRIMARY, fallbacks)
    assert answer.status_code == 422, answer.text
    assert says in answer.json()["error"]["message"]
    assert ServedModel.objects.get(name=PRIMARY).fallbacks == []
    assert not Event.objects.filter(kind="model_changed").exists()


def test_a_loop_is_refused_through_models_and_aliases(
    router: RouterServer, backup: RunningSimulator
) -> None:
    ServedModel.objects.create(name=PRIMARY)
    assert configure(router, PRIMARY, [BACKUP]).status_code == 200
    loop = configure(router, BACKUP, [PRIMARY])
    assert loop.status_code == 422
    assert loop.json()["error"]["message"] == (
        f"fallbacks may not loop: {BACKUP} → {PRIMARY} → {BACKUP}"
    )
    made = router.post(
        "/api/aliases",
        json={"name": "fb-chat", "targets": {BACKUP: 1}, "fallbacks": ["nope"]},
        headers=ADMIN_HEADERS,
    )
    assert made.status_code == 422 and "unknown fallback `nope`" in made.json()["error"]["message"]
    assert not Alias.objects.exists()  # refused whole, not created without its fallbacks
    router.post("/api/aliases", json={"name": "fb-chat", "targets": {BACKUP: 1}},
                headers=ADMIN_HEADERS)  # fmt: skip
    assert configure(router, BACKUP, ["fb-chat"]).status_code == 200
    via_alias = httpx.patch(f"{router.url}/api/aliases/fb-chat", json={"fallbacks": [PRIMARY]},
                            headers=ADMIN_HEADERS)  # fmt: skip
    assert via_alias.status_code == 422
    assert via_alias.json()["error"]["message"] == (
        f"fallbacks may not loop: fb-chat → {PRIMARY} → {BACKUP} → fb-chat"
    )
