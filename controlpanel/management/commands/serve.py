"""`manage.py serve`: everything a first run needs, in one command.

Migrates, makes a first admin, then runs the ASGI server (uvicorn), a Celery worker with
beat, and optionally N simulated vLLM workers, as child processes. Ctrl-C or SIGTERM
stops them all; if one dies, the others are stopped too rather than limping on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import FrameType
from typing import Any

import httpx
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlpanel import services
from controlpanel.models import Worker

DEMO_MODELS = [
    # (model, LoRA adapters): two workers share a model so balancing is visible.
    ("llama-3.1-8b-instruct", ["sql-lora"]),
    ("llama-3.1-8b-instruct", ["sql-lora"]),
    ("qwen2.5-7b-instruct", []),
]
STOP_GRACE_SECONDS = 10.0


class Command(BaseCommand):
    help = "Run the control panel and router (uvicorn), Celery with beat, and demo workers."
    requires_migrations_checks = False

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument(
            "--demo", type=int, default=0, metavar="N", help="also run N simulated vLLM workers"
        )
        parser.add_argument("--demo-base-port", type=int, default=18101)
        parser.add_argument("--no-celery", action="store_true", help="run no Celery worker")

    def handle(self, *args: Any, **options: Any) -> None:
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.stopping = False
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        call_command("migrate", interactive=False, verbosity=0)
        self._announce_admin(options["host"], options["port"])
        try:
            self._start_children(options)
            self._supervise()
        finally:
            self._stop_children()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _announce_admin(self, host: str, port: int) -> None:
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        base = f"http://{shown_host}:{port}"
        password = services.admin_bootstrap()
        if password:
            self.stdout.write(
                self.style.SUCCESS(
                    f"\nCreated the first staff user.\n  user:     admin\n  password: {password}\n"
                    f"  log in:   {base}/admin/\n(shown once; for real deployments run "
                    "`python manage.py createsuperuser`)\n"
                )
            )
        self.stdout.write(f"Router (OpenAI API): {base}/v1   API docs: {base}/api/docs\n")

    def _start_children(self, options: dict[str, Any]) -> None:
        python = sys.executable
        manage = str(settings.BASE_DIR / "manage.py")
        demo_urls = [
            self._spawn_simulator(python, manage, index, options["demo_base_port"] + index)
            for index in range(options["demo"])
        ]
        self._spawn(
            "uvicorn",
            [
                python,
                "-m",
                "uvicorn",
                "controlpanel.asgi:application",
                "--host",
                options["host"],
                "--port",
                str(options["port"]),
                "--lifespan",
                "on",
                "--no-access-log",
                "--timeout-graceful-shutdown",
                "30",
            ],
        )
        if not options["no_celery"]:
            self._spawn(
                "celery",
                [
                    python,
                    "-m",
                    "celery",
                    "-A",
                    "controlpanel",
                    "worker",
                    "--beat",
                    "--pool",
                    "threads",
                    "--concurrency",
                    "4",
                    "--loglevel",
                    "INFO",
                ],
            )
        for url in demo_urls:
            self._register_demo_worker(url)

    def _spawn_simulator(self, python: str, manage: str, index: int, port: int) -> str:
        model, loras = DEMO_MODELS[index % len(DEMO_MODELS)]
        command = [
            python,
            manage,
            "simulate_vllm",
            "--port",
            str(port),
            "--model",
            model,
            "--ttft-ms",
            "40",
            "--itl-ms",
            "15",
            "--max-batch",
            "4",
        ]
        for lora in loras:
            command += ["--lora", lora]
        self._spawn(f"sim-{index + 1}", command)
        return f"http://127.0.0.1:{port}"

    def _spawn(self, name: str, command: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.children.append((name, subprocess.Popen(command, env=env)))

    def _register_demo_worker(self, url: str) -> None:
        _wait_until_serving(url, timeout=30.0)
        try:
            services.worker_add(url=url, name=f"demo-{url.rsplit(':', 1)[1]}", actor="serve --demo")
        except services.WorkerAlreadyExists:
            worker = Worker.objects.get(url=url)
            services.worker_activate(worker_id=worker.pk, actor="serve --demo")
        self.stdout.write(f"demo worker {url} registered\n")

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
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for name, child in self.children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stderr.write(f"{name} did not stop in time; killing it\n")
                child.kill()
                child.wait()


def _wait_until_serving(url: str, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise CommandError(f"simulated worker {url} did not start within {timeout:.0f} s")
