"""`manage.py serve`: everything a first run needs, in one command.

Migrates, makes a first admin, then runs the ASGI server (uvicorn), a Celery worker with
beat, and with `--demo N` a small simulated fleet: N simulated vLLM workers, each joined by
its own worker agent (as real vLLM servers would be), plus light client traffic so queues
and in-flight counts move. Ctrl-C or SIGTERM stops every child; if one dies, the others
are stopped too rather than limping on.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from types import FrameType
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlpanel import rollouts, services
from controlpanel.models import Alias

DEMO_MODELS = [
    # (model, LoRA adapters): two workers share a model so balancing is visible.
    ("llama-3.1-8b-instruct", ["sql-lora"]),
    ("llama-3.1-8b-instruct", ["sql-lora"]),
    ("qwen2.5-7b-instruct", []),
]
# Simulated GPUs per demo worker, as tensor-parallel sizes: one strip of two, one of one.
DEMO_GPUS = (2, 2, 1)
DEMO_ALIAS = "chat"
# Children get this long after SIGTERM beyond the router's own grace for open streams.
STOP_MARGIN_SECONDS = 5.0


class Command(BaseCommand):
    help = "Run the router and control panel (uvicorn), Celery with beat, and a demo fleet."
    requires_migrations_checks = False

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument(
            "--demo", type=int, default=0, metavar="N", help="also run N simulated vLLM workers"
        )
        parser.add_argument("--demo-base-port", type=int, default=18101)
        parser.add_argument(
            "--demo-traffic",
            type=float,
            default=2.0,
            metavar="RPS",
            help="requests per second the demo client sends (0: none)",
        )
        parser.add_argument("--no-celery", action="store_true", help="run no Celery worker")

    def handle(self, *args: Any, **options: Any) -> None:
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.stopping = False
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        call_command("migrate", interactive=False, verbosity=0)
        self.env = self._child_env(demo=options["demo"] > 0)
        base = self._announce(options["host"], options["port"])
        try:
            self._start_server(options)
            if options["demo"]:
                self._start_demo(options, base)
            self._supervise()
        finally:
            self._stop_children()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _child_env(self, *, demo: bool) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if demo and not settings.CONTROLPANEL_WORKER_TOKEN:
            # The demo's agents need a worker token; one made for this run only keeps
            # the agent API closed to anyone else.
            env["CONTROLPANEL_WORKER_TOKEN"] = secrets.token_urlsafe(24)
        return env

    def _announce(self, host: str, port: int) -> str:
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        base = f"http://{shown_host}:{port}"
        password = services.admin_bootstrap()
        if password:
            self.stdout.write(
                self.style.SUCCESS(
                    f"\nCreated the first staff user.\n  user:      admin\n"
                    f"  password:  {password}\n  dashboard: {base}/\n"
                    "(shown once; for real deployments run `python manage.py createsuperuser`)\n"
                )
            )
        self.stdout.write(
            f"Dashboard: {base}/   OpenAI API: {base}/v1   API docs: {base}/api/docs\n"
        )
        return base

    def _start_server(self, options: dict[str, Any]) -> None:
        python = sys.executable
        self._spawn(
            "uvicorn",
            [python, "-m", "uvicorn", "controlpanel.asgi:application",
             "--host", options["host"], "--port", str(options["port"]),
             "--lifespan", "on", "--no-access-log",
             "--timeout-graceful-shutdown", str(settings.ROUTER_SHUTDOWN_GRACE)],
        )  # fmt: skip
        if not options["no_celery"]:
            self._spawn(
                "celery",
                [python, "-m", "celery", "-A", "controlpanel", "worker", "--beat",
                 "--pool", "threads", "--concurrency", "4", "--loglevel", "WARNING"],
            )  # fmt: skip

    def _start_demo(self, options: dict[str, Any], base: str) -> None:
        python, manage = sys.executable, str(settings.BASE_DIR / "manage.py")
        for index in range(options["demo"]):
            port = options["demo_base_port"] + index
            model, loras = DEMO_MODELS[index % len(DEMO_MODELS)]
            simulator = [python, manage, "simulate_vllm", "--port", str(port), "--model", model,
                         "--ttft-ms", "60", "--itl-ms", "25", "--max-batch", "4",
                         "--gpus", str(DEMO_GPUS[index % len(DEMO_GPUS)])]  # fmt: skip
            for lora in loras:
                simulator += ["--lora", lora]
            self._spawn(f"sim-{index + 1}", simulator)
            self._spawn(
                f"agent-{index + 1}",
                [python, manage, "worker_agent", "--controller", base,
                 "--worker-url", f"http://127.0.0.1:{port}", "--name", f"demo-{index + 1}",
                 "--interval", "2", "--dcgm-url", f"http://127.0.0.1:{port}/dcgm-metrics"],
            )  # fmt: skip
        if options["demo_traffic"] > 0:
            self._spawn(
                "demo-traffic",
                [python, "-m", "routing.demo_traffic", "--url", base,
                 "--rps", str(options["demo_traffic"])],
            )  # fmt: skip
        self.stdout.write(f"Demo: {options['demo']} simulated workers join through agents.\n")
        if not Alias.objects.filter(name=DEMO_ALIAS).exists():
            # Something for the rollouts page: try moving `chat` from llama to qwen.
            rollouts.alias_create(
                name=DEMO_ALIAS,
                targets={DEMO_MODELS[0][0]: 100},
                description="demo alias: plan a rollout to qwen2.5-7b-instruct",
                actor="demo",
            )

    def _spawn(self, name: str, command: list[str]) -> None:
        self.children.append((name, subprocess.Popen(command, env=self.env)))

    def _supervise(self) -> None:
        while not self.stopping:
            for name, child in self.children:
                if child.poll() is not None:
                    raise CommandError(f"{name} exited with code {child.returncode}; stopping")
            time.sleep(0.5)

    def _stop_children(self) -> None:
        for _, child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + settings.ROUTER_SHUTDOWN_GRACE + STOP_MARGIN_SECONDS
        for name, child in self.children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stderr.write(f"{name} did not stop in time; killing it\n")
                child.kill()
                child.wait()
