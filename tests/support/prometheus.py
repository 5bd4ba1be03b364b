"""The shipped Grafana dashboard and Prometheus rules (deploy/), read as Prometheus and
Grafana read them, and Debian's Prometheus tools (`make test` and .ci/run install them)."""

from __future__ import annotations

import json
import shutil

from tests.support.common import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "controlpanel.json"
RULES = ROOT / "deploy" / "prometheus" / "controlpanel-rules.yaml"
# Grafana's own variables, as it would fill them in for a short time range.
GRAFANA_VARIABLES = {"$__rate_interval": "15s", "$__interval": "5s"}


def tool(name: str) -> str:
    found = shutil.which(name)
    assert found, f"{name} is missing: `make test` and .ci/run install Debian's prometheus"
    return found


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    return [substituted(expr) for expr in found]


def substituted(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a variable this test does not know: {expr}"
    return expr
