"""launcher.plan: the command line `manage.py serve` writes, into a Plan, refused with a usage
message where it asks for what cannot work."""

from __future__ import annotations

import pytest

from launcher.plan import Child, Plan, plan_from_args

REDIS = {"REDIS_URL": "redis://127.0.0.1:6379/0"}


def test_the_defaults_are_one_router_on_port_8000_and_no_children() -> None:
    assert plan_from_args([], {}) == Plan(1, "127.0.0.1", 8000, 30, (), None)


def test_each_kind_of_child_is_shell_split_and_flagged() -> None:
    plan = plan_from_args(
        [
            "--routers", "2", "--host", "::", "--port", "0", "--grace", "5",
            "--ready-path", "/healthz",
            "--child", "celery", "celery -A controlpanel worker --loglevel 'info warn'",
            "--server-child", "vllm", "/tmp/vllm.log", "vllm serve m --port 8100",
            "--ready-child", "demo", "python -m simulator.demo_traffic --url http://x",
            "--url-child", "agent", "http://127.0.0.1:8100/health", "python agent.py",
        ],
        REDIS,
    )  # fmt: skip
    assert (plan.routers, plan.host, plan.port, plan.grace) == (2, "::", 0, 5)
    assert plan.ready_path == "/healthz"
    assert plan.children == (
        Child("celery", ("celery", "-A", "controlpanel", "worker", "--loglevel", "info warn")),
        Child("vllm", ("vllm", "serve", "m", "--port", "8100"), group=True, log="/tmp/vllm.log"),
        Child("demo", ("python", "-m", "simulator.demo_traffic", "--url", "http://x"),
              after_ready=True),
        Child("agent", ("python", "agent.py"), wait_url="http://127.0.0.1:8100/health"),
    )  # fmt: skip


def test_several_routers_need_redis_named_by_url_or_file(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        plan_from_args(["--routers", "3"], {})
    assert exited.value.code == 2
    assert "--routers 3 needs REDIS_URL" in capsys.readouterr().err
    assert plan_from_args(["--routers", "3"], {"REDIS_URL_FILE": "/run/secret"}).routers == 3


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--routers", "0"], "integer >= 1"),
        (["--port", "-1"], "integer >= 0"),
        (["--grace", "soon"], "integer >= 0"),
        (["--url-child", "agent", "https://x/health", "true"], "is not an http:// URL"),
        (["--child", "only-a-name"], "expected 2 arguments"),
    ],
)
def test_what_cannot_work_is_refused_with_a_message(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        plan_from_args(argv, REDIS)
    assert said in capsys.readouterr().err
