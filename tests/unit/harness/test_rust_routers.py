"""The Rust peer routers' plan, offline: where their venv goes (named by the pins), each
router's command line, and what is installed already found without running pip; an
unknown name is refused before anything runs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness import rust_routers


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONTROLPANEL_VLLM_CACHE", str(tmp_path))

    def no_installs(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"nothing may be installed here: {args}")

    monkeypatch.setattr(subprocess, "run", no_installs)
    return tmp_path


def test_the_venv_is_named_by_the_pins(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = rust_routers.venv_dir()
    assert first.parent == cache and first.name.startswith("rust-routers-")
    assert rust_routers.venv_dir() == first
    monkeypatch.setitem(rust_routers.PINS, "vllm-router", "vllm-router==9.9.9")
    assert rust_routers.venv_dir() != first


def test_installed_routers_are_found_without_pip(cache: Path) -> None:
    venv = rust_routers.venv_dir()
    venv.mkdir(parents=True)
    (venv / ".venv-ready").touch()
    for pin in rust_routers.PINS.values():
        (venv / f".installed-{pin}").touch()
    found = rust_routers.peer_commands(["vllm-router", "sglang-router"])
    assert found == {name: venv / "bin" / name for name in ("vllm-router", "sglang-router")}
    assert rust_routers.peer_commands([]) == {}


def test_an_unknown_router_is_refused_before_anything_runs(cache: Path) -> None:
    with pytest.raises(ValueError, match="unknown routers"):
        rust_routers.peer_commands(["nginx"])
    with pytest.raises(ValueError, match="unknown router 'nginx'"):
        rust_routers.peer_args("nginx", Path("/x"), "127.0.0.1", (1, 2), [])


def test_a_failed_step_comes_back_as_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("no python")

    monkeypatch.setattr(subprocess, "run", missing)
    assert rust_routers._run(["python", "-m", "venv"]) == "python -m venv: no python"


def test_each_routers_command_line() -> None:
    workers = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    vllm = rust_routers.peer_args("vllm-router", Path("/v/vllm-router"), "127.0.0.1",
                                  (9000, 9001), workers)  # fmt: skip
    assert vllm[0] == "/v/vllm-router" and vllm[-2:] == ["--log-level", "warning"]
    at = vllm.index("--worker-urls")
    assert vllm[at + 1 : at + 3] == workers
    assert vllm[vllm.index("--port") + 1] == "9000"
    assert vllm[vllm.index("--prometheus-port") + 1] == "9001"
    assert vllm[vllm.index("--policy") + 1] == "round_robin"
    sglang = rust_routers.peer_args("sglang-router", Path("/v/sglang-router"), "127.0.0.1",
                                    (9000, 9001), workers)  # fmt: skip
    assert sglang[:2] == ["/v/sglang-router", "launch"] and sglang[-1] == "warn"
