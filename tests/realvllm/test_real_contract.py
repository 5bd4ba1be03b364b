"""vLLM 0.32's wire contract (tests/support/vllm_live.py) on real vLLM: the same live checks the
simulator passes in tests/e2e/test_vllm_contract.py, so neither can drift from the other."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from tests.realvllm.servers import LORA, MODEL, RealWorker
from tests.support.vllm_live import (
    LiveSource,
    check_live_errors,
    check_live_kv_events_and_replay,
    check_live_metrics,
    check_live_models_and_simple_gets,
)


@pytest.fixture
def live(vllm_pair: list[RealWorker], tiny_folder: object) -> LiveSource:
    real = vllm_pair[1]
    adapter = f"{tiny_folder}/{LORA}"  # loaded again at run time under another name
    return LiveSource(real.url, MODEL, "lora-b", real.kv_events, real.kv_events_replay, adapter)


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_real_kv_events_and_replay_meet_the_contract(
    live: LiveSource, zmq_ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    check_live_kv_events_and_replay(live, zmq_ctx)


def test_real_metrics_meet_the_contract(live: LiveSource) -> None:
    check_live_metrics(live)


def test_real_models_and_simple_gets_meet_the_contract(live: LiveSource) -> None:
    check_live_models_and_simple_gets(live)


def test_real_errors_meet_the_contract(live: LiveSource) -> None:
    check_live_errors(live)
