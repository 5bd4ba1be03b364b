"""The commands a user runs: `serve --demo` and `worker_agent`, as real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from controlpanel.registry.models import Worker
from tests.support.common import ROOT
from tests.support.servers import (
    WAIT_CEILING_S,
    RouterServer,
    StartSimulator,
    free_port_run,
    subprocess_env,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)


def children_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_serve_demo_runs_everything_and_stops_everything(tmp_path: Path) -> None:
    port, demo_port = free_port_run(1), free_port_run(6)
    # The demo's agents beat every 2 s: the test settings' 3 s expiry would drop a worker
    # whose beat a busy machine delays by a second (routable, then not, then again).
    env = subprocess_env(
        tmp_path,
        DATABASE_URL=f"sqlite:///{tmp_path / 'serve.sqlite3'}",
        CONTROLPANEL_HEARTBEAT_EXPIRY="30",
    )
    log_path = tmp_path / "serve.log"
    command = [
        sys.executable,
        "manage.py",
        "serve",
        "--port",
        str(port),
        "--routers",  # one process, whatever REDIS_URL says: the test counts the children
        "1",
        "--demo",
        "2",
        "--demo-base-port",
        str(demo_port),
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"

        def both_workers_routable() -> bool:
            try:
                workers = httpx.get(f"{base}/list_workers", timeout=10).json()["workers"]
            except httpx.HTTPError:
                return False
            return len(workers) == 2 and all(w["routable"] for w in workers)

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)

        def models() -> set[str]:
            return {m.id for m in client.models.list()}

        # An agent registers its engine before it has reported the engine's models: routable
        # first, the model list (and the demo's alias on it) filled a report later.
        demo_models = {"llama-3.1-8b-instruct", "sql-lora", "chat"}
        try:
            wait_until(both_workers_routable, timeout=2 * WAIT_CEILING_S, interval=0.3)
            wait_until(lambda: models() >= demo_models)
        except AssertionError as exc:  # what serve printed is the only clue CI keeps
            raise AssertionError(f"{exc}\n--- serve's output ---\n{log_path.read_text()}") from None
        assert (
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            ).model
            == "chat"
        )
        reply = client.chat.completions.create(
            model="sql-lora", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.choices[0].message.content
        output = log_path.read_text()
        assert "user:      admin" in output and "password:  " in output
        assert f"dashboard: http://127.0.0.1:{port}/" in output
        children = children_of(proc.pid)
        # uvicorn, celery, two simulators, their two agents and the demo client
        assert len(children) == 7
        sources = {w["source"] for w in httpx.get(f"{base}/list_workers").json()["workers"]}
        assert sources == {"agent"}

        def streams_connected() -> bool:  # each engine's KV events, given by its agent
            workers = httpx.get(f"{base}/list_workers").json()["workers"]
            return all((w.get("kv_events") or {}).get("connected") for w in workers)

        wait_until(streams_connected)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    for child in children:
        assert (
            not Path(f"/proc/{child}").exists()
            or "zombie" in Path(f"/proc/{child}/status").read_text()
        )


def test_worker_agent_registers_beats_and_drains_on_sigterm(
    router: RouterServer, simulator: StartSimulator, tmp_path: Path
) -> None:
    sim = simulator("m", itl_ms=50)
    command = [
        sys.executable,
        "manage.py",
        "worker_agent",
        "--controller",
        router.url,
        "--worker-url",
        sim.url,
        "--interval",
        "0.3",
        "--name",
        "agent-test",
    ]
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=subprocess_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        worker = wait_until(lambda: Worker.objects.filter(name="agent-test").first())
        router.wait_routable(worker)
        # A long request keeps the worker busy: the agent reports it from vLLM's /metrics.
        body = {"model": "m", "prompt": "x", "max_tokens": 60}
        busy = threading.Thread(target=lambda: router.post("/v1/completions", json=body))
        busy.start()
        wait_until(lambda: Worker.objects.get(pk=worker.pk).queue_length == 1)
        busy.join()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_until(lambda: Worker.objects.get(pk=worker.pk).state in ("draining", "drained"))
    router.wait_for(lambda seen: seen[worker.pk]["state"] == "drained")
