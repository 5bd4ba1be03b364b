"""`serve --demo-real N` without starting vLLM: what it plans (read back through the
launcher's own parser) and what it refuses. The launcher's two new kinds of child (a server
in a process group of its own, and a child that waits for a URL), with plain processes, are
tests/e2e/test_launcher_children.py.

The real thing, real vLLM included, is tests/realvllm/test_real_demo.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from controlpanel.console import real_demo
from controlpanel.registry.models import ServedModel
from harness import real_vllm
from harness.tokenizer_folder import make_tokenizer_folder
from launcher.plan import Child, plan_from_args

pytestmark = pytest.mark.django_db(transaction=True)
GIB = 1024**3
VLLM_PYTHON = Path("/opt/vllm-env/bin/python")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_tokenizer_folder(tmp_path / "smollm2-test")


@pytest.fixture
def launched(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path, tmp_path: Path
) -> Iterator[list[list[str]]]:
    """serve as far as the launcher's command line: nothing is built, exec'd or started."""
    commands: list[list[str]] = []
    monkeypatch.setattr(real_vllm, "vllm_python", lambda: VLLM_PYTHON)
    monkeypatch.setattr(real_vllm, "model_folder", lambda kind, under=None: model_dir)
    monkeypatch.setattr(real_demo, "memory_available", lambda meminfo=None: 64 * GIB)
    monkeypatch.setattr(real_demo, "_taken", lambda port: False)
    monkeypatch.setattr(os, "execve", lambda path, argv, env: commands.append(list(argv)))
    yield commands


def plan_of(command: list[str]) -> dict[str, Child]:
    """Read back as the launcher would, in this environment: with REDIS_URL set (the
    PostgreSQL and Redis run), `serve` asks for a router per core, which the launcher
    refuses without it."""
    assert command[1:3] == ["-m", "launcher"], command
    return {child.name: child for child in plan_from_args(command[3:], os.environ).children}


def option(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_demo_real_2_plans_two_servers_their_agents_and_chats(
    launched: list[list[str]], model_dir: Path
) -> None:
    call_command("serve", "--demo-real", "2", "--demo-base-port", "18201", "--port", "18999")
    children = plan_of(launched[0])
    assert set(children) == {
        "celery", "vllm-1", "vllm-2", "agent-1", "agent-2", "demo-traffic",
    }  # fmt: skip
    for index, port in ((1, 18201), (2, 18202)):
        server = children[f"vllm-{index}"]
        assert server.group and server.log and server.log.endswith(f"vllm-real-{index}.log")
        assert not server.after_ready and server.wait_url is None  # started at once
        argv = server.command
        assert argv[:3] == ("env", "-u", "PYTHONPATH") and "HF_HUB_OFFLINE=1" in argv
        entry = argv.index(str(VLLM_PYTHON))
        assert argv[entry + 1 : entry + 3] == ("-m", "vllm.entrypoints.openai.api_server")
        assert option(argv, "--model") == str(model_dir)
        assert option(argv, "--served-model-name") == "smollm2-135m"
        assert option(argv, "--port") == str(port)
        assert option(argv, "--block-size") == "32"
        kv = json.loads(option(argv, "--kv-events-config"))
        events, replay = 18301 + 2 * (index - 1), 18302 + 2 * (index - 1)
        assert kv["endpoint"] == f"tcp://*:{events}"
        assert kv["replay_endpoint"] == f"tcp://*:{replay}"
        agent = children[f"agent-{index}"]
        assert agent.wait_url == f"http://127.0.0.1:{port}/health"
        assert "worker_agent" in agent.command
        assert option(agent.command, "--worker-url") == f"http://127.0.0.1:{port}"
        assert option(agent.command, "--controller") == "http://127.0.0.1:18999"
        assert "--kv-events" not in agent.command  # discovered from GET /kv_event_sources
    traffic = children["demo-traffic"]
    assert traffic.after_ready and "--chats" in traffic.command
    assert option(traffic.command, "--model") == "smollm2-135m"
    assert option(traffic.command, "--rps") == "0.5"
    # no simulated fleet beside the real one, and no demo alias to a model that is not here
    assert not any(name.startswith("sim-") for name in children)
    model = ServedModel.objects.get(name="smollm2-135m")
    assert (model.policy, model.tokenizer) == ("kv_aware", str(model_dir))


def test_a_second_run_changes_no_setting_again(launched: list[list[str]]) -> None:
    call_command("serve", "--demo-real", "1", "--no-celery")
    before = ServedModel.objects.get(name="smollm2-135m").updated_at
    call_command("serve", "--demo-real", "1", "--no-celery")
    assert ServedModel.objects.get(name="smollm2-135m").updated_at == before


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--demo-real", "0"], "from 1 up"),
        (["--demo-real", "-1"], "from 1 up"),
        (["--demo", "2", "--demo-real", "1"], "choose one"),
    ],
)
def test_refused_before_anything_starts(
    launched: list[list[str]], args: list[str], said: str
) -> None:
    with pytest.raises(CommandError, match=said):
        call_command("serve", *args)
    assert not launched


def test_refused_without_the_memory(
    launched: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(real_demo, "memory_available", lambda meminfo=None: 5 * GIB)
    with pytest.raises(CommandError) as raised:
        call_command("serve", "--demo-real", "2")
    assert "needs about 7.0 GiB of free memory" in str(raised.value)
    assert "5.0 GiB available" in str(raised.value)
    assert not launched


def test_a_port_in_use_is_named(launched: list[list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real_demo, "_taken", lambda port: port == 18302)
    with pytest.raises(CommandError, match="port 18302 is in use"):
        call_command("serve", "--demo-real", "1", "--demo-base-port", "18201")


def test_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    2097152 kB\n")
    assert real_demo.memory_available(meminfo) == 2 * GIB
    assert real_demo.memory_available(tmp_path / "absent") is None
    refusal = real_demo.real_demo_refusal(1, meminfo)
    assert refusal is not None and "3.5 GiB" in refusal
