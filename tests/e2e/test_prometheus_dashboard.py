"""deploy/grafana and deploy/prometheus against a real Prometheus (Debian's package, installed
by `make test` and .ci/run): it scrapes the project in demo mode (`manage.py serve --demo 3`,
simulated vLLM workers joined by their agents, Celery probing them) while this test sends
keyed traffic, sets a prefix_aware policy and plans and rolls back a rollout; then every
PromQL expression of the dashboard must return data. The rules' and the dashboard's offline
checks are tests/unit/deploy/test_dashboards.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.common import ADMIN_HEADERS, ROOT
from tests.support.prometheus import RULES, dashboard_expressions, tool
from tests.support.servers import free_port, free_port_run, stop_process, wait_until

SERVICE_MONITOR = ROOT / "deploy/kubernetes/components/servicemonitor/servicemonitor.yaml"
MODEL, OTHER, ALIAS = "llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "chat"
PD_MODEL = "pd-demo"  # a disaggregated model: a simulated prefill and decode server
SCRAPE_SECONDS = 1


def project_env(var_dir: Path, **extra: str) -> dict[str, str]:
    # Its own SQLite and no Redis: the demo's Celery must not share a broker with the suite's.
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=f"sqlite:///{var_dir / 'demo.sqlite3'}",
        CONTROLPANEL_VAR_DIR=str(var_dir),
        CONTROLPANEL_PROBE_INTERVAL="1",
        CONTROLPANEL_HEARTBEAT_EXPIRY="10",
        CONTROLPANEL_REQUIRE_API_KEY="1",
        CONTROLPANEL_ACCESS_LOG="0",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    port, base = free_port_run(1), free_port_run(9)  # 3 engines: HTTP and 2 KV ports each
    env = project_env(tmp_path)
    # One router process: Prometheus scrapes the port, which is one target only then.
    command = [sys.executable, "manage.py", "serve", "--port", str(port), "--routers", "1",
               "--demo", "3",
               "--demo-base-port", str(base), "--demo-traffic", "0"]  # fmt: skip
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _demo_ready(url, proc, tmp_path), timeout=60, interval=0.5)
        yield url, env
    finally:
        stop_process(proc, timeout=20)
        log.close()


def _demo_ready(url: str, proc: subprocess.Popen[bytes], var_dir: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError((var_dir / "serve.log").read_text(errors="replace")[-3000:])
    try:
        health = httpx.get(url + "/health", timeout=2).json()
    except httpx.HTTPError:
        return False
    return bool(health.get("routable_workers", 0) >= 3)


@pytest.fixture
def prometheus(tmp_path: Path, demo: tuple[str, dict[str, str]]) -> Iterator[str]:
    port = demo[0].rsplit(":", 1)[1]
    config = {
        "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": shipped_scrape_configs([f"127.0.0.1:{port}", f"localhost:{port}"]),
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    command = [tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
               f"--storage.tsdb.path={tmp_path / 'tsdb'}",
               f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(url + "/-/ready"), interval=0.2)
        yield url
    finally:
        stop_process(proc)
        log.close()


def shipped_scrape_configs(targets: list[str]) -> list[dict[str, Any]]:
    """The shipped ServiceMonitor's endpoints as Prometheus scrape jobs (what the operator
    makes of it), each over `targets`: two names of the one demo router stand for two router
    pods, so a panel that counted the pods' identical control-plane series twice would show
    it. The dashboard's panels must have data from exactly what is shipped."""
    monitor = yaml.safe_load(SERVICE_MONITOR.read_text())
    return [
        {
            "job_name": f"endpoint-{i}",
            "metrics_path": endpoint.get("path", "/metrics"),
            "static_configs": [{"targets": targets}],
        }
        for i, endpoint in enumerate(monitor["spec"]["endpoints"])
    ]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def client_key(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", "create_api_key", "dashboard-test"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


def send_traffic(url: str, key: str, stop: threading.Event) -> None:
    """Streams and plain answers for both models and the alias, with the client's key."""
    headers = {"Authorization": f"Bearer {key}"}
    bodies: list[dict[str, Any]] = [
        {"model": MODEL, "messages": [{"role": "user", "content": "a shared prefix " * 20}]},
        {"model": OTHER, "prompt": "hello", "max_tokens": 8, "stream": True},
        {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "stream": True},
        {"model": PD_MODEL, "prompt": "a long prompt " * 40, "max_tokens": 4, "stream": True},
    ]
    with httpx.Client(base_url=url, headers=headers, timeout=10) as client:
        while not stop.is_set():
            for body in bodies:
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                client.post(path, json=body)
            time.sleep(0.05)  # the traffic's pace, not a wait


def disaggregated_model(url: str, simulator: Callable[..., Any]) -> None:
    """A prefill and a decode server for PD_MODEL (the P/D row), every prompt prefilled."""
    with httpx.Client(base_url=url, headers=ADMIN_HEADERS, timeout=10) as admin:
        for role in ("prefill", "decode"):
            sim = simulator(PD_MODEL, role=role, ttft_ms=20, itl_ms=5)
            added = admin.post("/api/workers", json={"url": sim.url, "role": role})
            assert added.status_code == 201, added.text
        wait_until(lambda: admin.get(f"/api/models/{PD_MODEL}").status_code == 200)
        bypass = admin.patch(f"/api/models/{PD_MODEL}", json={"pd_bypass_tokens": 0})
        assert bypass.status_code == 200, bypass.text


def control_plane_changes(url: str, prometheus: str) -> None:
    """A prefix_aware model (policy decisions) and a rollout rolled back (rollout series)."""
    with httpx.Client(base_url=url, headers=ADMIN_HEADERS, timeout=10) as admin:
        policy = {"policy": "prefix_aware"}
        assert admin.patch(f"/api/models/{MODEL}", json=policy).status_code == 200
        steps = [{"weight": 50, "hold_seconds": 600}, {"weight": 100, "hold_seconds": 0}]
        plan = {"alias": ALIAS, "to_target": OTHER, "steps": steps}
        created = admin.post("/api/rollouts", json=plan)
        assert created.status_code == 201, created.text
        plan_id = created.json()["id"]
        wait_until(lambda: admin.get(f"/api/rollouts/{plan_id}").json()["state"] == "running")
        # The running plan and the alias's split to its new target are scraped before the
        # rollback ends them.
        running = f'controlpanel_rollouts{{alias="{ALIAS}",state="running"}} > 0'
        split = f'controlpanel_router_alias_requests_total{{alias="{ALIAS}",target="{OTHER}"}}'
        wait_until(lambda: query(prometheus, running) and query(prometheus, split), interval=0.5)
        rolled = admin.post(f"/api/rollouts/{plan_id}/rollback")
        assert rolled.status_code == 200, rolled.text


def query(prometheus: str, expr: str) -> list[Any]:
    answer = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    result: list[Any] = answer["data"]["result"]
    return result


def test_every_dashboard_expression_returns_data(
    demo: tuple[str, dict[str, str]], prometheus: str, simulator: Callable[..., Any]
) -> None:
    url, env = demo
    disaggregated_model(url, simulator)
    stop = threading.Event()
    traffic = threading.Thread(target=send_traffic, args=(url, client_key(env), stop))
    traffic.start()
    try:
        control_plane_changes(url, prometheus)
        expressions = dashboard_expressions()
        missing: list[str] = list(expressions)

        def all_answered() -> bool:
            missing[:] = [expr for expr in expressions if not query(prometheus, expr)]
            return not missing

        try:
            wait_until(all_answered, timeout=90, interval=2)
        except AssertionError:
            pytest.fail("no data for:\n" + "\n".join(missing))
    finally:
        stop.set()
        traffic.join(timeout=15)
    # The rules load in the server too, every one evaluates cleanly (the recording group's
    # first evaluation may take its 30 s interval), and the recording rules produce series.
    wait_until(lambda: rules_healthy(prometheus), timeout=45, interval=1)
    # A rate needs two scrapes inside its window before the group's next evaluation.
    wait_until(
        lambda: query(prometheus, "controlpanel:router_requests:rate5m"), timeout=75, interval=2
    )


def rules_healthy(prometheus: str) -> bool:
    groups = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert {g["name"] for g in groups} == {"controlpanel-recording", "controlpanel-alerts"}
    health = [r["health"] for g in groups for r in g["rules"]]
    assert "err" not in health, groups
    return all(h == "ok" for h in health)
