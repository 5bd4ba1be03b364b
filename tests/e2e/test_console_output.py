"""What `serve --demo` prints, as an operator watching the terminal reads it: one line per
operational event in one timestamp format, from every process (the router's and Celery's
alike); the access log's JSON in a file, not on the console; no banner, root warning or
start-up race. And the access log's sampling, on a real router."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.common import ROOT
from tests.support.servers import (
    RouterServer,
    SimulatorLoop,
    StartSimulator,
    free_port_run,
    start_router,
    stop_process,
    subprocess_env,
    wait_until,
)

ADMIN = {"Authorization": "Bearer test-admin-token-0123456789"}  # tests/settings.py
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"
LOG_LINE = re.compile(rf"^{STAMP} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
# Lines that are not log lines: serve's own banner, and Celery's farewell.
NOT_LOG = re.compile(
    r"^(|Created the first staff user\.|  (user|password|dashboard): .*|\(shown once; .*"
    r"|Dashboard: .*|Access log \(JSON, one line per request\): .*|Demo: .*"
    r"|worker: (Warm|Cold) shutdown \(MainProcess\))$"
)


def _serve(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port_run(1)
    env = subprocess_env(
        tmp_path,
        DATABASE_URL=f"sqlite:///{tmp_path / 'serve.sqlite3'}",
        CONTROLPANEL_PROBE_INTERVAL="0.5",
        # The demo's agents beat every 2 s: the test settings' 3 s expiry would drop a worker
        # whose beat a busy machine delays by a second.
        CONTROLPANEL_HEARTBEAT_EXPIRY="30",
    )
    env.pop("CONTROLPANEL_ACCESS_LOG_FILE", None)
    log_path = tmp_path / "console.log"
    command = [sys.executable, "manage.py", "serve", "--port", str(port), "--routers", "1",
               "--demo", "2",
               "--demo-base-port", str(free_port_run(6)), "--demo-traffic", "4"]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log_path


def _workers(base: str) -> list[dict[str, object]]:
    try:
        return list(httpx.get(f"{base}/list_workers", timeout=2).json()["workers"])
    except httpx.HTTPError:
        return []


def test_serve_demo_prints_one_line_per_event_and_keeps_the_access_log_in_a_file(
    tmp_path: Path, simulator: StartSimulator, sim_loop: SimulatorLoop
) -> None:
    proc, base, log_path = _serve(tmp_path)
    try:
        try:
            wait_until(
                lambda: len(_workers(base)) == 2 and all(w["routable"] for w in _workers(base)),
                timeout=90,
                interval=0.3,
            )
        except AssertionError as exc:  # say what serve printed, or this is undiagnosable
            raise AssertionError(f"{exc}; serve printed:\n{log_path.read_text()}") from exc
        drained = _workers(base)[0]  # a demo worker: the other one still serves its model
        doomed = simulator("doomed-model")
        added = httpx.post(
            f"{base}/api/workers", json={"url": doomed.url, "name": "gpu-doomed"},
            headers=ADMIN, timeout=10,
        )  # fmt: skip
        assert added.status_code in (200, 201), added.text
        answer = httpx.post(f"{base}/api/workers/{drained['id']}/drain", headers=ADMIN, timeout=10)
        assert answer.status_code == 200, answer.text
        answer = httpx.patch(
            f"{base}/api/models/llama-3.1-8b-instruct", json={"policy": "round_robin"},
            headers=ADMIN, timeout=10,
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        # Nothing routes to it, so only Celery's probes can find it gone: the event's line
        # comes from the Celery process.
        sim_loop.run(doomed.stop())
        wait_until(lambda: "Worker unhealthy gpu-doomed:" in log_path.read_text(), timeout=60)
        access_log = tmp_path / "access.log"
        wait_until(lambda: access_log.exists() and '"/v1/' in access_log.read_text())
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    output = log_path.read_text()
    lines = output.splitlines()
    events = [line for line in lines if " INFO controlpanel.events: " in line]
    text = "\n".join(events)
    assert re.search(r"Worker joined demo-1: registered with models .* \(by agent\)", text)
    assert re.search(r"Worker joined demo-2: ", text)
    assert re.search(rf"Drain started {drained['name']}: drain requested \(by ", text)
    assert "Policy changed: llama-3.1-8b-instruct: shortest_queue -> round_robin" in text
    assert "Worker joined gpu-doomed: added with models doomed-model" in text
    assert re.search(r"Worker unhealthy gpu-doomed: ", text), text
    # Every other line is a log line in the one format, or serve's own few words.
    strays = [line for line in lines if not LOG_LINE.match(line) and not NOT_LOG.match(line)]
    assert not strays, strays
    assert f"Access log (JSON, one line per request): {tmp_path / 'access.log'}" in output
    assert '"request_id"' not in output  # the JSON went to the file...
    requests = [json.loads(line) for line in (tmp_path / "access.log").read_text().splitlines()]
    assert any(r["path"].startswith("/v1/") and r["status"] == 200 for r in requests)
    for noise in ("celery@", "-------------- ", "superuser privileges", "unreachable"):
        assert noise not in output, noise


def test_the_access_log_goes_to_a_file_and_keeps_every_failure_when_sampled(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sampled.log"
    server: RouterServer = start_router(
        tmp_path, CONTROLPANEL_ACCESS_LOG_FILE=str(path), CONTROLPANEL_ACCESS_LOG_SAMPLE="0"
    )
    try:
        for _ in range(5):
            assert server.get("/health").status_code == 200
        assert server.get("/v1/no-such-route").status_code == 404
        assert server.post("/v1/chat/completions", content=b"{not json").status_code == 400
        wait_until(lambda: path.exists() and path.read_text().count("\n") >= 2)
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert sorted(r["status"] for r in lines) == [400, 404], lines
        assert '"request_id"' not in server.log()  # not on the console
    finally:
        stop_process(server.proc)
