"""vLLM 0.32's wire contract (tests/support/vllm_contract.py's assertions, vllm_live.py's live
checks) on the captures of real vLLM and on a live simulator through real sockets; the
real-vLLM tier runs the same live checks on real vLLM (tests/realvllm/test_real_contract.py),
so the simulator cannot drift from it again."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import zmq

from tests.support.servers import StartSimulator, free_ports
from tests.support.vllm_contract import (
    assert_kv_message,
    assert_metrics_like,
    assert_metrics_page,
    assert_prefill_params,
    assert_replay_answer,
    capture,
    captured_messages,
    captured_replay,
)
from tests.support.vllm_live import (
    LiveSource,
    check_live_errors,
    check_live_kv_events_and_replay,
    check_live_metrics,
    check_live_models_and_simple_gets,
    check_live_pd,
)


@pytest.fixture(params=["simulator"])
def live(request: pytest.FixtureRequest, simulator: StartSimulator) -> LiveSource:
    pub, replay = free_ports(2)
    sim = simulator(
        "contract-model",
        kv_events_port=pub,
        kv_events_replay_port=replay,
        enable_prompt_tokens_details=True,
        block_size=16,
        max_model_len=1024,
    )
    host = "tcp://127.0.0.1"
    return LiveSource(sim.url, "contract-model", "lora-a", f"{host}:{pub}", f"{host}:{replay}")


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.mark.parametrize("name", ["kv-events-smollm2.jsonl", "kv-events-tiny-excerpt.jsonl"])
def test_captured_batches_meet_the_contract(name: str) -> None:
    kinds = set()
    for frames in captured_messages(name):
        _, events = assert_kv_message(frames)
        kinds |= {e["type"] for e in events}
    assert "BlockStored" in kinds


def test_captured_replay_answer_meets_the_contract() -> None:
    assert [seq for seq, _ in assert_replay_answer(captured_replay())] == [0, 1, 2]


def test_captured_metrics_meet_the_contract() -> None:
    text = capture("metrics-tiny.txt").read_text()
    families = assert_metrics_page(text)
    assert "vllm:lora_requests_info" in families
    assert_metrics_like(text, text)


def test_observed_prefill_params_meet_the_contract() -> None:
    record = json.loads(capture("pd-prefill-params.json").read_text())
    params, n, bs = record["kv_transfer_params"], record["prompt_tokens"], record["block_size"]
    assert_prefill_params(params, n, bs)


# -- a live simulator -----------------------------------------------------------------------


def test_live_kv_events_and_replay_meet_the_contract(
    live: LiveSource, zmq_ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    check_live_kv_events_and_replay(live, zmq_ctx)


def test_live_metrics_meet_the_contract(live: LiveSource) -> None:
    check_live_metrics(live)


def test_live_models_and_simple_gets_meet_the_contract(live: LiveSource) -> None:
    check_live_models_and_simple_gets(live)


def test_live_errors_meet_the_contract(live: LiveSource) -> None:
    check_live_errors(live)


def test_live_prefill_and_decode_meet_the_contract(simulator: StartSimulator) -> None:
    knobs = {"enable_prompt_tokens_details": True, "block_size": 16, "max_model_len": 1024}
    p = simulator("contract-model", role="prefill", **knobs)
    d = simulator("contract-model", role="decode", **knobs)
    check_live_pd(
        LiveSource(p.url, "contract-model", "", "", ""),
        LiveSource(d.url, "contract-model", "", "", ""),
    )
