"""The Rust routers the overhead benchmark measures the router against: vLLM's and SGLang's.

``vllm-router`` (the vLLM project's router) and ``sglang-router`` (SGLang's model gateway)
ship as wheels on the package index, each a Python launcher around a compiled Rust server.
:func:`peer_commands` installs them once per machine into a venv of their own, outside the
repository under ``$CONTROLPANEL_VLLM_CACHE`` (default ``~/.cache/controlpanel``, as
harness/real_vllm.py's), in ``rust-routers-<hash of the pins>``: change a pin and the next
run builds a new one. Each package is installed on its own and marked done on its own, so one
that fails to install (no wheel for this machine, no index) leaves the other usable; the
failure comes back as a sentence, never as a stand-in.

:func:`peer_args` is each router's command line in front of some workers: round robin per
request, on 127.0.0.1, warnings only in its log, its metrics on a port of its own; nothing
else changed from its defaults. The standard library only.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.real_vllm import cache_dir

# name -> pin; the name is also the benchmark's mode and the venv's command.
PINS: dict[str, str] = {
    "vllm-router": "vllm-router==0.1.17",
    "sglang-router": "sglang-router==0.3.2",
}
INSTALL_TIMEOUT_S = 900.0


def venv_dir() -> Path:
    key = hashlib.sha256("\n".join(sorted(PINS.values())).encode()).hexdigest()[:12]
    return cache_dir() / f"rust-routers-{key}"


def _run(args: Sequence[str]) -> str | None:
    """Run an install step with its output on stderr; None when it worked, else why not."""
    try:
        done = subprocess.run(
            list(args), stdout=sys.stderr, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(args)}: {exc}"
    return None if done.returncode == 0 else f"{' '.join(args)} exited with {done.returncode}"


def _venv() -> tuple[Path, str | None]:
    """The venv's bin folder, made first if missing (built in place: venvs do not move)."""
    venv = venv_dir()
    if (venv / ".venv-ready").exists():
        return venv / "bin", None
    venv.parent.mkdir(parents=True, exist_ok=True)
    error = _run([sys.executable, "-m", "venv", "--clear", str(venv)])
    if error is None:
        error = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-U", "pip"])
    if error is None:
        (venv / ".venv-ready").touch()
    return venv / "bin", error


def peer_commands(names: Sequence[str]) -> dict[str, Path | str]:
    """Each named router's executable, installed first if this machine has none for its pin,
    or a sentence saying why it cannot be had."""
    unknown = [name for name in names if name not in PINS]
    if unknown:
        raise ValueError(f"unknown routers {unknown}: {', '.join(PINS)}")
    if not names:
        return {}
    bin_dir, error = _venv()
    if error is not None:
        return {name: f"could not build the venv: {error}" for name in names}
    found: dict[str, Path | str] = {}
    for name in names:
        marker = bin_dir.parent / f".installed-{PINS[name]}"
        if not marker.exists():
            print(f"installing {PINS[name]} into {bin_dir.parent} ...", file=sys.stderr)
            error = _run([str(bin_dir / "python"), "-m", "pip", "install", "-q", PINS[name]])
            if error is not None:
                found[name] = f"could not install {PINS[name]}: {error}"
                continue
            marker.touch()
        found[name] = bin_dir / name
    return found


def peer_args(
    name: str, command: Path, host: str, ports: tuple[int, int], workers: Sequence[str]
) -> list[str]:
    """The command line of router `name` in front of `workers`, round robin per request, on
    ``host``: ``ports`` is (serving, Prometheus metrics: on by default, each instance needs
    its own). Log level warning: no line per request, as the router's ``--no-access-log``."""
    port, metrics = ports
    common = [
        "--host", host, "--port", str(port), "--worker-urls", *workers,
        "--policy", "round_robin", "--prometheus-host", host, "--prometheus-port", str(metrics),
    ]  # fmt: skip
    if name == "vllm-router":
        return [str(command), *common, "--log-level", "warning"]
    if name == "sglang-router":
        return [str(command), "launch", *common, "--log-level", "warn"]
    raise ValueError(f"unknown router {name!r}: {', '.join(PINS)}")
