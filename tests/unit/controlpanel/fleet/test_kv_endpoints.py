"""A worker's KV events endpoints from vLLM 0.32's GET /kv_event_sources answer, parsed by
the pure function (controlpanel.fleet.kv_endpoints): the worker's host for an any-address,
only a listening ZeroMQ publisher, rank 0, and the endpoints an operator gave checked."""

from __future__ import annotations

from typing import Any

import pytest

from controlpanel.fleet.kv_endpoints import (
    InvalidKvEventsEndpoint,
    kv_endpoints_given,
    kv_sources_from,
)

# vLLM 0.32's answer, as captured (vllm-captures/observed.md)
REAL = {
    "0": {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "kv-events",
    }
}


def rank(**changes: Any) -> dict[str, Any]:
    return {**REAL["0"], **changes}


def test_the_real_answer_gives_the_workers_host_and_ports() -> None:
    found = kv_sources_from(REAL, worker_url="http://gpu-1:8000")
    assert (found.kv_events, found.kv_events_replay) == ("tcp://gpu-1:5557", "tcp://gpu-1:5558")
    assert found.note == "KV events discovered at tcp://gpu-1:5557 (replay tcp://gpu-1:5558)"


@pytest.mark.parametrize("bound", ["tcp://0.0.0.0:5557", "tcp://[::]:5557", "tcp://:5557"])
def test_every_any_address_is_replaced_by_the_workers_host(bound: str) -> None:
    found = kv_sources_from({"0": rank(endpoint=bound, replay_endpoint=None)},
                            worker_url="http://10.1.2.3:8000")  # fmt: skip
    assert (found.kv_events, found.kv_events_replay) == ("tcp://10.1.2.3:5557", "")
    ipv6 = kv_sources_from({"0": rank(endpoint=bound)}, worker_url="http://[fd00::7]:8000")
    assert (ipv6.kv_events, ipv6.kv_events_replay) == ("tcp://[fd00::7]:5557",
                                                       "tcp://[fd00::7]:5558")  # fmt: skip


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        # publishing nothing is said nowhere: it is no news
        ({}, ""),
        ([], ""),
        ("off", ""),
        ({"0": rank(enable_kv_cache_events=False)}, ""),
        ({"0": None}, ""),
        ({"0": rank(publisher="null")}, "'null', not zmq"),
        ({"0": rank(endpoint=None)}, "no endpoint"),
        ({"0": rank(endpoint="ipc:///tmp/kv")}, "not a TCP endpoint"),
        ({"0": rank(endpoint="tcp://*:99999")}, "endpoint must be tcp://host:port"),
        # vLLM binds only on a wildcard: with a named host its publisher connects out
        ({"0": rank(endpoint="tcp://10.0.0.5:5557")}, "vLLM connects out to it"),
    ],
)
def test_only_a_listening_zmq_publisher_counts(payload: Any, why: str) -> None:
    found = kv_sources_from(payload, worker_url="http://gpu-1:8000")
    assert (found.kv_events, found.kv_events_replay) == ("", "")
    assert why in found.note if why else found.note == ""


def test_a_replay_socket_is_always_bound_so_its_host_is_kept_and_a_bad_one_costs_only_it() -> None:
    named = kv_sources_from({"0": rank(replay_endpoint="tcp://10.0.0.5:5558")},
                            worker_url="http://gpu-1:8000")  # fmt: skip
    assert (named.kv_events, named.kv_events_replay) == ("tcp://gpu-1:5557", "tcp://10.0.0.5:5558")
    bad = kv_sources_from({"0": rank(replay_endpoint="tcp://*:0")}, worker_url="http://gpu-1:1")
    assert (bad.kv_events, bad.kv_events_replay) == ("tcp://gpu-1:5557", "")
    assert "replay not used" in bad.note


def test_rank_0_is_followed_and_the_other_ranks_are_named() -> None:
    ranks = {"1": rank(endpoint="tcp://*:5567"), "0": REAL["0"], "2": rank(endpoint="tcp://*:5577")}
    found = kv_sources_from(ranks, worker_url="http://gpu-1:8000")
    assert found.kv_events == "tcp://gpu-1:5557"
    assert "data-parallel ranks 1, 2 publish too; routers follow rank 0 only" in found.note


def test_what_was_given_is_checked_and_none_means_ask_the_worker() -> None:
    assert kv_endpoints_given(None, None) == (None, None)
    assert kv_endpoints_given("", None) == ("", "")
    assert kv_endpoints_given(None, "") == (None, "")
    assert kv_endpoints_given(None, "tcp://h:2") == (None, "tcp://h:2")
    assert kv_endpoints_given("tcp://h:1", None) == ("tcp://h:1", "")
    for bad in [("tcp://*:1", None), (None, "udp://h:2"), ("", "tcp://h:2")]:
        with pytest.raises(InvalidKvEventsEndpoint):
            kv_endpoints_given(*bad)
