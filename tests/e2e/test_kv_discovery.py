"""A worker's KV events endpoints read from the worker itself (vLLM 0.32's GET
/kv_event_sources) when it is added without them: through the admin API, the dashboard's
add form and the agent's registration. An operator's endpoint wins, "" keeps them off, and
an older vLLM (404, or an answer that is not JSON) is added as before, with none.

The answer's parsing by the pure function (controlpanel.fleet.kv_endpoints) is
tests/unit/controlpanel/fleet/test_kv_endpoints.py; here it runs end to end: the session's
router (the admin API and the pages run in it), simulated vLLM servers that answer
/kv_event_sources as vLLM 0.32 does and publish over ZeroMQ, and a small aiohttp server for
the older vLLM that has no such route."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from controlpanel.fleet import services
from controlpanel.fleet.agent import Agent
from controlpanel.registry.choices import EventKind
from controlpanel.registry.models import Event, Worker
from simulator.server import RunningSimulator
from tests.support.common import ADMIN_HEADERS, AGENT_HEADERS
from tests.support.login import logged_in
from tests.support.servers import RouterServer, SimulatorLoop, StartSimulator, free_ports

db = pytest.mark.django_db(transaction=True)


def add(router: RouterServer, url: str, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{router.url}/api/workers", json={"url": url, **body}, headers=ADMIN_HEADERS, timeout=15
    )


def publishing(simulator: StartSimulator, model: str, replay: bool = True) -> RunningSimulator:
    port, replay_port = free_ports(2)
    return simulator(model, block_size=4, cache_blocks=8, kv_events_port=port,
                     kv_events_replay_port=replay_port if replay else 0)  # fmt: skip


def ports(sim: RunningSimulator) -> tuple[int, int | None]:
    return sim.state.config.kv_events_port, sim.state.config.kv_events_replay_port


def joined(worker_id: int) -> str:
    return Event.objects.get(worker_id=worker_id, kind=EventKind.WORKER_JOINED).message


def subscribed(router: RouterServer, worker_id: int) -> None:
    router.wait_for(lambda seen: bool((seen[worker_id]["kv_events"] or {}).get("connected")))


@db
def test_the_api_reads_the_endpoints_from_the_worker_and_the_routers_subscribe(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = publishing(simulator, "disc-a")
    stream, replay = ports(sim)
    answer = add(router, sim.url)
    assert answer.status_code == 201, answer.text
    body = answer.json()
    # the simulator says tcp://*:port as vLLM does; the worker URL's host replaces the *
    assert (body["kv_events"], body["kv_events_replay"]) == (
        f"tcp://127.0.0.1:{stream}",
        f"tcp://127.0.0.1:{replay}",
    )
    assert f"KV events discovered at tcp://127.0.0.1:{stream}" in joined(body["id"])
    subscribed(router, body["id"])


@db
def test_an_operators_endpoints_win_and_an_empty_one_keeps_them_off(
    router: RouterServer, simulator: StartSimulator
) -> None:
    given = publishing(simulator, "disc-given")
    stream, replay = ports(given)
    explicit = {"kv_events": f"tcp://localhost:{stream}",
                "kv_events_replay": f"tcp://localhost:{replay}"}  # fmt: skip
    answer = add(router, given.url, **explicit)
    assert answer.status_code == 201, answer.text
    assert {k: answer.json()[k] for k in explicit} == explicit
    assert "discovered" not in joined(answer.json()["id"])

    off = publishing(simulator, "disc-off")
    answer = add(router, off.url, kv_events="")
    assert answer.status_code == 201, answer.text
    assert (answer.json()["kv_events"], answer.json()["kv_events_replay"]) == ("", "")

    # the stream read from the worker, its replay turned off by the operator
    no_replay = publishing(simulator, "disc-no-replay")
    answer = add(router, no_replay.url, kv_events_replay="")
    assert answer.status_code == 201, answer.text
    stream, _ = ports(no_replay)
    assert (answer.json()["kv_events"], answer.json()["kv_events_replay"]) == (
        f"tcp://127.0.0.1:{stream}",
        "",
    )
    # a bad endpoint given is still a 422 before anything is asked of the worker
    refused = add(router, "http://127.0.0.1:9", kv_events="tcp://*:5557")
    assert refused.status_code == 422 and "kv_events must be" in refused.text


@pytest.fixture
def old_vllm(sim_loop: SimulatorLoop) -> Iterator[Callable[[str], str]]:
    """A server that lists its model but answers /kv_event_sources as an older vLLM would
    (404), or with something that is not JSON; returns its URL."""
    runners: list[web.AppRunner] = []

    async def start(kind: str) -> str:
        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": f"old-{kind}"}]})

        async def html(request: web.Request) -> web.Response:
            return web.Response(text="<html>events</html>", content_type="text/html")

        app = web.Application()
        app.router.add_get("/v1/models", models)
        if kind == "html":
            app.router.add_get("/kv_event_sources", html)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield lambda kind: str(sim_loop.run(start(kind)))
    for runner in runners:
        sim_loop.run(runner.cleanup())


@db
@pytest.mark.parametrize("kind", ["404", "html"])
def test_an_older_vllm_is_added_without_endpoints(
    router: RouterServer, old_vllm: Callable[[str], str], kind: str
) -> None:
    answer = add(router, old_vllm(kind))
    assert answer.status_code == 201, answer.text
    assert (answer.json()["kv_events"], answer.json()["kv_events_replay"]) == ("", "")
    assert joined(answer.json()["id"]) == f"added with models old-{kind}"


@db
def test_a_worker_without_events_is_added_without_endpoints(
    router: RouterServer, simulator: StartSimulator
) -> None:
    answer = add(router, simulator("disc-none").url)
    assert answer.status_code == 201, answer.text
    assert answer.json()["kv_events"] == ""
    assert joined(answer.json()["id"]) == "added with models disc-none"


@db
def test_the_add_form_reads_them_from_the_worker(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = publishing(simulator, "disc-form", replay=False)
    session = logged_in(router)
    session.get("/")
    form = {"url": sim.url, "kv_events": "", "csrfmiddlewaretoken": session.cookies["csrftoken"]}
    response = session.post("/workers/add", data=form, headers={"Referer": f"{router.url}/"})
    assert response.status_code == 302
    worker = Worker.objects.get(url=sim.url)
    stream, _ = ports(sim)
    assert (worker.kv_events, worker.kv_events_replay) == (f"tcp://127.0.0.1:{stream}", "")
    assert "no replay endpoint" in joined(worker.pk)
    page = session.get("/").text  # the message after the redirect names the stream
    assert f"KV events: tcp://127.0.0.1:{stream}" in page


@db
def test_an_agent_registers_with_the_workers_endpoints_and_a_clearing_sticks(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = publishing(simulator, "disc-agent")
    token = AGENT_HEADERS["Authorization"][7:]
    agent = Agent(controller=router.url, worker_url=sim.url, token=token, interval=0.2)
    agent.register()
    assert agent.worker_id is not None
    stream, replay = ports(sim)
    worker = Worker.objects.get(pk=agent.worker_id)
    assert (worker.kv_events, worker.kv_events_replay) == (
        f"tcp://127.0.0.1:{stream}",
        f"tcp://127.0.0.1:{replay}",
    )
    assert "KV events discovered" in joined(worker.pk)
    subscribed(router, worker.pk)
    # An operator turns them off; the agent registering again (a restarted server) does
    # not read them back: a known worker keeps what the operator set.
    services.worker_update(worker_id=worker.pk, name=None, weight=None, kv_events="",
                           kv_events_replay="", actor="test")  # fmt: skip
    agent.register()
    assert Worker.objects.get(pk=worker.pk).kv_events == ""

    # an agent told "" registers none
    other = publishing(simulator, "disc-agent-off")
    quiet = Agent(controller=router.url, worker_url=other.url, token=token, kv_events="")
    quiet.register()
    assert Worker.objects.get(pk=quiet.worker_id).kv_events == ""
    agent.http.close()
    quiet.http.close()
