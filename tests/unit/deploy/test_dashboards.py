"""deploy/grafana and deploy/prometheus, offline: the rules load with `promtool check rules`
(Debian's prometheus package, installed by `make test` and .ci/run), and the dashboard is
Grafana JSON with the rows asked for. Every expression of it returning data from a real
Prometheus is tests/e2e/test_prometheus_dashboard.py."""

from __future__ import annotations

import json
import re
import subprocess

from tests.support.prometheus import DASHBOARD, RULES, tool


def test_the_rules_load_with_promtool() -> None:
    done = subprocess.run(
        [tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"SUCCESS: \d+ rules found", done.stdout)


def test_the_dashboard_is_grafana_json_with_the_panels_asked_for() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    rows = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert rows == {
        "Fleet health",
        "Per-model traffic, latency and TTFT",
        "Per-worker queue, KV cache and GPU",
        "Routing decisions per policy",
        "Rollouts",
        "Key usage",
        "Prefill/decode disaggregation",
    }
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
