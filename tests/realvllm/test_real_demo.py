"""`manage.py serve --demo-real 1`, as a user runs it: a real vLLM server (SmolLM2-135M on
the CPU) starts under the launcher, its agent registers it, the control plane discovers its
KV events endpoints, the router answers a chat with the model's real text and routes the
conversation's next turn on the worker's own KV events (kv_aware), and SIGTERM stops the
whole tree, vLLM's engine process included.

The model folder is the project's var/models (converted once from the wheel's GGUF), linked
into this run's own var folder, so the test pays for the conversion only on a fresh machine.
Numbers come from /list_workers, the explanation header and vLLM's own usage report."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from controlpanel.console.real_demo import MODEL_NAME
from harness.real_vllm import START_TIMEOUT_S
from tests.support.common import ROOT
from tests.support.servers import free_port_run, subprocess_env, wait_until

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def server_group(launcher: int) -> int | None:
    """The launcher's child that leads a process group of its own: the vLLM server. (Its
    /proc/PID/cmdline is not read: that can block while vLLM maps its weights.)"""
    path = Path(f"/proc/{launcher}/task/{launcher}/children")
    for child in (int(pid) for pid in path.read_text().split()) if path.exists() else ():
        try:
            if os.getpgid(child) == child:
                return child
        except ProcessLookupError:
            continue
    return None


def group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # the state, then ppid, then pgrp
            members.append(int(stat.parent.name))
    return members


def the_worker(base: str) -> dict[str, Any] | None:
    """The one worker once it is routable with its KV events connected and its index
    trusted (the replay of the engine's history applied); None before."""
    try:
        workers = httpx.get(f"{base}/list_workers", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError):
        return None
    if len(workers) != 1:
        return None
    worker: dict[str, Any] = workers[0]
    events = worker.get("kv_events") or {}
    ready = (events.get("index") or {}).get("trust") == "ready"
    return worker if worker["routable"] and events.get("connected") and ready else None


def kv_index(base: str) -> dict[str, Any]:
    """The router's index of the one worker's blocks, once it holds some; {} before."""
    index: dict[str, Any] = ((the_worker(base) or {}).get("kv_events") or {}).get("index") or {}
    return index if index.get("blocks") else {}


def chat(base: str, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any], str]:
    """(the answer's text, its usage, the router's explanation) for one turn, greedy."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 24, "temperature": 0}
    response = httpx.post(
        f"{base}/v1/chat/completions", json=body, headers={"X-Route-Explain": "1"}, timeout=120
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    return (
        answer["choices"][0]["message"]["content"],
        answer["usage"],
        response.headers["X-Route-Explain"],
    )


def test_serve_demo_real_routes_real_text_on_real_kv_events_and_stops_everything(
    tmp_path: Path,
) -> None:
    models = ROOT / "var" / "models"
    models.mkdir(parents=True, exist_ok=True)
    (tmp_path / "models").symlink_to(models)
    port = free_port_run(1)
    demo_port = free_port_run(102)  # HTTP at base, KV events at base + 100 and + 101
    env = subprocess_env(tmp_path, DATABASE_URL=f"sqlite:///{tmp_path / 'serve.sqlite3'}")
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "manage.py", "serve", "--port", str(port),
               "--demo-real", "1", "--demo-base-port", str(demo_port)]  # fmt: skip
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base, group = f"http://127.0.0.1:{port}", None
    try:

        def ready() -> dict[str, Any] | None:
            assert proc.poll() is None, f"serve exited:\n{log_path.read_text()}"
            return the_worker(base)

        group = wait_until(lambda: server_group(proc.pid), timeout=120, interval=0.5)
        try:
            worker = wait_until(ready, timeout=START_TIMEOUT_S, interval=1.0)
        except AssertionError as exc:
            vllm_log = (tmp_path / "vllm-real-1.log").read_text()[-3000:]
            raise AssertionError(
                f"{exc}\n--- serve ---\n{log_path.read_text()}\n--- vLLM ---\n{vllm_log}"
            ) from None
        print(f"serve --demo-real 1: routable with a trusted index after "
              f"{time.monotonic() - started:.0f} s")  # fmt: skip
        assert worker["name"] == "real-1" and worker["models"] == [MODEL_NAME]
        assert worker["kv_events"]["endpoint"] == f"tcp://127.0.0.1:{demo_port + 100}"
        assert worker["kv_events"]["replay_endpoint"] == f"tcp://127.0.0.1:{demo_port + 101}"

        # Real text from the real model, through the router, tokenized on the router.
        text, _, explained = chat(base, FRANCE)
        assert "Paris" in text, text
        assert '"policy":"kv_aware"' in explained and '"source":"events"' in explained
        # The next turn starts with the first one: its blocks are in the worker's cache, the
        # router's index learned them from the worker's events, and vLLM agrees it reused them.
        index = wait_until(lambda: kv_index(base), timeout=60)
        assert index["block_size"] == 32  # the demo's, learned from the events
        turn = [*FRANCE, {"role": "assistant", "content": text},
                {"role": "user", "content": "And of Italy?"}]  # fmt: skip
        _, usage, explained = chat(base, turn)
        assert '"decision":"kv"' in explained, explained
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 32, usage
        assert "Policy changed: smollm2-135m: shortest_queue -> kv_aware" in log_path.read_text()
        assert "KV events discovered at" in log_path.read_text()
        members = group_members(group)
        assert len(members) >= 2, members  # the API server and its engine core
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=90)
        finally:
            if group is not None and group_members(group):
                os.killpg(group, signal.SIGKILL)  # never leave 3 GiB behind, whatever failed
    assert code == 0, log_path.read_text()[-3000:]
    assert group is not None and not group_members(group), "vLLM processes left running"
