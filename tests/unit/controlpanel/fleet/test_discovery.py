"""Discovery (controlpanel.fleet.discovery) against a real HTTP server in this process
(tests.support.http_peer): what a server's /v1/models and /kv_event_sources say, what is
refused, and the model lists agents send."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from controlpanel.fleet import discovery
from controlpanel.fleet.errors import NotAVllmServer, RequestLoop, WorkerUnreachable
from controlpanel.registry.models import RoutingGeneration
from routing.listings import DEPLOYMENT_HEADER
from tests.support.http_peer import HttpPeer, http_peer
from tests.support.servers import free_port

pytestmark = pytest.mark.django_db


@pytest.fixture
def peer() -> Iterator[HttpPeer]:
    with http_peer() as server:
        yield server


def test_models_keep_what_routing_needs_once_per_id_in_order(peer: HttpPeer) -> None:
    data = [
        {"id": "base", "root": "/m/base", "parent": None, "max_model_len": 4096, "created": 1},
        {"id": "lora-a", "root": "/l/a", "parent": "base", "owned_by": "vllm"},
        {"id": "base", "root": "/elsewhere"},
    ]
    peer.answer("/v1/models", {"object": "list", "data": data})
    entries = discovery.discover_models(url=peer.url, api_key="sk-upstream")
    assert entries == [
        {"id": "base", "parent": None, "root": "/m/base", "max_model_len": 4096, "created": 1},
        {"id": "lora-a", "parent": "base", "root": "/l/a", "max_model_len": None, "created": None},
    ]
    path, headers = peer.seen[-1]
    assert path == "/v1/models" and headers["Authorization"] == "Bearer sk-upstream"


@pytest.mark.parametrize(
    ("status", "body", "words"),
    [
        (401, {"error": "Unauthorized"}, "set the worker's API key"),
        (500, "oops", "HTTP 500, not a model list"),
        (200, "<html>hello</html>", "did not return an OpenAI model list"),
        (200, {"object": "list", "data": []}, "lists no model"),
        (200, {"object": "list", "data": [{"id": "x" * 400}]}, "bad model id"),
        (200, {"models": ["m"]}, "expected"),
    ],
)
def test_what_is_not_a_vllm_model_list_is_refused(
    peer: HttpPeer, status: int, body: object, words: str
) -> None:
    peer.answer("/v1/models", body, status=status)
    with pytest.raises(NotAVllmServer, match=words):
        discovery.discover_models(url=peer.url)


def test_a_wrong_key_is_named_as_such(peer: HttpPeer) -> None:
    peer.answer("/v1/models", {"error": "Unauthorized"}, status=401)
    with pytest.raises(NotAVllmServer, match="the worker's API key is wrong"):
        discovery.discover_models(url=peer.url, api_key="sk-wrong")


def test_nothing_listening_is_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(WorkerUnreachable, match=f"cannot reach {url}/v1/models"):
        discovery.discover_models(url=url)


def test_a_router_of_this_deployment_is_refused_and_another_passes(peer: HttpPeer) -> None:
    header = DEPLOYMENT_HEADER.decode()
    RoutingGeneration.bump()  # the first change gives the deployment its identity
    peer.models("m")
    peer.answers["/v1/models"].headers[header] = "another-deployment"
    assert [e["id"] for e in discovery.discover_models(url=peer.url)] == ["m"]
    peer.answers["/v1/models"].headers[header] = RoutingGeneration.deployment_id()
    with pytest.raises(RequestLoop, match="send requests in a loop"):
        discovery.discover_models(url=peer.url)


def test_kv_event_sources_give_reachable_endpoints(peer: HttpPeer) -> None:
    rank0 = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
             "replay_endpoint": "tcp://*:5558"}  # fmt: skip
    peer.answer("/kv_event_sources", {"0": rank0})
    found = discovery.discover_kv_events(url=peer.url)
    assert (found.kv_events, found.kv_events_replay) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    )
    assert "KV events discovered at tcp://127.0.0.1:5557" in found.note


def test_kv_event_sources_never_fail(peer: HttpPeer) -> None:
    # an older vLLM: no such route, quietly nothing
    assert discovery.discover_kv_events(url=peer.url).kv_events == ""
    assert discovery.discover_kv_events(url=peer.url).note == ""
    peer.answer("/kv_event_sources", "not json")
    assert discovery.discover_kv_events(url=peer.url).kv_events == ""
    gone = discovery.discover_kv_events(url=f"http://127.0.0.1:{free_port()}")
    assert gone.kv_events == "" and "cannot reach" in gone.note


def test_given_endpoints_win_and_a_given_replay_overrides_the_servers(peer: HttpPeer) -> None:
    rank0 = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
             "replay_endpoint": "tcp://*:5558"}  # fmt: skip
    peer.answer("/kv_event_sources", {"0": rank0})
    given = ("tcp://10.0.0.1:1", "")
    assert discovery.kv_endpoints_settled(given, url=peer.url, api_key="") == (
        "tcp://10.0.0.1:1", "", "",
    )  # fmt: skip
    assert len(peer.seen) == 0  # nothing asked when the stream was given
    stream, replay, note = discovery.kv_endpoints_settled((None, ""), url=peer.url, api_key="")
    assert (stream, replay) == ("tcp://127.0.0.1:5557", "")
    assert note.startswith("; KV events discovered")


def test_model_keys_ignore_the_creation_stamp() -> None:
    a = [{"id": "m", "parent": None, "root": "m", "max_model_len": 8, "created": 1}]
    b = [{**a[0], "created": 2}]
    assert discovery.model_keys(a) == discovery.model_keys(b)
    assert discovery.model_keys(a) != discovery.model_keys([{**a[0], "max_model_len": 16}])


def test_an_agent_may_send_names_or_entries_but_not_nothing() -> None:
    entries = discovery.models_from_agent(["a", {"id": "b", "parent": "a"}, "a"])
    assert [(e["id"], e["parent"]) for e in entries] == [("a", None), ("b", "a")]
    with pytest.raises(NotAVllmServer, match="not usable"):
        discovery.models_from_agent([])
    with pytest.raises(NotAVllmServer, match="not usable"):
        discovery.models_from_agent([{"name": "no id"}])
