"""The real-vLLM tier's two servers: what they serve, and starting them (tests/realvllm/
conftest.py starts them once per session)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.real_vllm import VllmServer, model_folder, pd_env, server_args, vllm_python
from tests.support.servers import free_ports

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


def start_pd(log_dir: Path) -> dict[str, VllmServer]:
    """A prefill and a decode server of the tiny model (NixlConnector, pull mode, KV in host
    memory, each with its own NIXL side channel), started and not yet waited for."""
    python, model = vllm_python(), model_folder("tiny")
    servers = {}
    for role in ("prefill", "decode"):
        port, side_channel = free_ports(2)
        args = server_args(
            model, MODEL, port, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, role=role
        )
        log = log_dir / f"vllm-{role}.log"
        servers[role] = VllmServer(python, args, log, env=pd_env(side_channel)).start()
    return servers
