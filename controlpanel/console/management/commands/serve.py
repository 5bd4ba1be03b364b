"""`manage.py serve`: everything a first run needs, in one command.

Migrates, makes a first admin and prints where to log in, then hands over to the launcher
(`python -m launcher`, which loads no Django): it runs `--routers N` router processes
(uvicorn) on the one port, a Celery worker with beat, and with `--demo N` a small simulated
fleet: N simulated vLLM workers, each joined by its own worker agent (as real vLLM servers
would be), plus light client traffic so queues and in-flight counts move. `--demo-real N`
runs N real vLLM servers on the CPU instead (SmolLM2-135M, kv_aware on their KV events;
controlpanel.console.real_demo). Ctrl-C or SIGTERM stops every child; if one dies, the
others are stopped too rather than limping on.

Several routers share prefix knowledge, load and admission limits through Redis, so
`--routers N` with N > 1 is refused without `REDIS_URL`, and `--routers auto` (the default:
one per core) means one router without it.
"""

from __future__ import annotations

import os
import secrets
import shlex
import socket
import sys
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from controlpanel.console import real_demo
from controlpanel.registry import accounts
from controlpanel.registry.models import Alias
from controlpanel.rollouts import aliases

DEMO_MODELS = [
    # (model, LoRA adapters): two workers share a model so balancing is visible.
    ("llama-3.1-8b-instruct", ["sql-lora"]),
    ("llama-3.1-8b-instruct", ["sql-lora"]),
    ("qwen2.5-7b-instruct", []),
]
# Simulated GPUs per demo worker, as tensor-parallel sizes: one strip of two, one of one.
DEMO_GPUS = (2, 2, 1)
DEMO_ALIAS = "chat"
DEMO_BASE_PORT = 18101
DEMO_TRAFFIC_RPS = 2.0
# A real CPU worker answers a turn in a second or more: a gentler client keeps queues short.
REAL_DEMO_TRAFFIC_RPS = 0.5
CELERY_ROOT_WARNING = "You're running the worker with superuser privileges"

# (name, command line, whether it waits for a router to answer), for the launcher to run once
Children = list[tuple[str, list[str], bool]]


class Command(BaseCommand):
    help = "Run the routers and control panel (uvicorn), Celery with beat, and a demo fleet."
    requires_migrations_checks = False
    access_log = ""  # where the routers' access log goes, when not to the console

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument(
            "--routers",
            default=None,
            metavar="N",
            help="router processes serving the one port (default auto: one per core when "
            "REDIS_URL is set, else one; more than one needs REDIS_URL)",
        )
        parser.add_argument(
            "--demo", type=int, default=0, metavar="N", help="also run N simulated vLLM workers"
        )
        parser.add_argument(
            "--demo-real",
            type=int,
            default=None,
            metavar="N",
            help="also run N real vLLM servers on the CPU (SmolLM2-135M, about 3.5 GiB of "
            "memory and a minute to start each; the first run builds vLLM's venv, ~5 min)",
        )
        parser.add_argument(
            "--demo-base-port",
            type=int,
            default=None,
            help=f"the demo workers' first port (default {DEMO_BASE_PORT}; "
            f"{real_demo.DEFAULT_BASE_PORT} for --demo-real)",
        )
        parser.add_argument(
            "--demo-traffic",
            type=float,
            default=None,
            metavar="RPS",
            help=f"requests per second the demo client sends (0: none; default "
            f"{DEMO_TRAFFIC_RPS}, {REAL_DEMO_TRAFFIC_RPS} for --demo-real)",
        )
        parser.add_argument("--no-celery", action="store_true", help="run no Celery worker")

    def handle(self, *args: Any, **options: Any) -> None:
        routers = self._router_count(options["routers"])
        real = self._real_count(options)  # refused here, before anything is started
        call_command("migrate", interactive=False, verbosity=0)
        env = self._child_env(demo=options["demo"] > 0 or real > 0)
        base = self._announce(options["host"], options["port"], routers)
        children: Children = []
        if not options["no_celery"]:
            # --quiet: no banner. The warning about running as root is for a production
            # worker; here it is one process of a first run, often in a root container.
            # The one worker has no peers: no heartbeat events every 2 s, no gossip or
            # mingle, which only several workers (and monitors such as flower) use.
            children.append(
                ("celery", [sys.executable, "-W", f"ignore:{CELERY_ROOT_WARNING}", "-m",
                            "celery", "-A", "controlpanel", "--quiet", "worker", "--beat",
                            "--pool", "threads", "--concurrency", "4", "--loglevel", "WARNING",
                            "--without-heartbeat", "--without-gossip", "--without-mingle"],
                 False),
            )  # fmt: skip
        if options["demo"]:
            children += self._demo_children(options, base)
            self._demo_alias()
        extra = self._real_demo_args(options, base, real) if real else []
        self._launch(options, routers, children, env, extra)

    def _real_count(self, options: dict[str, Any]) -> int:
        count = options["demo_real"]
        if count is None:
            return 0
        if options["demo"]:
            raise CommandError("--demo and --demo-real are two demos: choose one")
        refusal = real_demo.real_demo_refusal(count)
        if refusal:
            raise CommandError(refusal)
        return int(count)

    def _real_demo_args(self, options: dict[str, Any], base: str, count: int) -> list[str]:
        """Build (once) what the real servers run, set the model up, plan the processes."""
        ports = real_demo.real_demo_ports(
            count, options["demo_base_port"] or real_demo.DEFAULT_BASE_PORT
        )

        def say(line: str) -> None:
            self.stdout.write(line + "\n")
            self.stdout.flush()  # before minutes of building

        fleet = real_demo.real_demo_prepare(models_dir=settings.VAR_DIR / "models", say=say)
        real_demo.real_demo_model(fleet=fleet)
        rps = options["demo_traffic"]
        args = real_demo.real_demo_launch_args(
            fleet=fleet,
            ports=ports,
            controller=base,
            manage=settings.BASE_DIR / "manage.py",
            log_dir=settings.VAR_DIR,
            traffic_rps=REAL_DEMO_TRAFFIC_RPS if rps is None else rps,
        )
        for index, (port, _, _) in enumerate(ports, start=1):
            say(f"Starting real vLLM worker {index}/{count} on :{port} "
                f"(log: {settings.VAR_DIR / f'vllm-real-{index}.log'})…")  # fmt: skip
        workers = "1 real vLLM worker serves" if count == 1 else f"{count} real vLLM workers serve"
        say(f"Demo: {workers} {real_demo.MODEL_NAME} (kv_aware). Each needs a minute or more "
            "to load; its agent registers it once it answers.")  # fmt: skip
        return args

    def _router_count(self, value: str | None) -> int:
        """--routers as a number; more than one only with Redis, where the routers share
        prefix knowledge, load and admission limits. The default (None) is auto: the
        machine's cores with Redis, quietly one without."""
        if value is None or value == "auto":
            if not settings.REDIS_URL:
                if value == "auto":
                    self.stdout.write("--routers auto: 1 router, since REDIS_URL is unset.\n")
                return 1
            return max(1, len(os.sched_getaffinity(0)))
        try:
            count = int(value)
        except ValueError:
            count = 0
        if count < 1:
            raise CommandError(f"--routers takes a number from 1 up or auto, not {value!r}")
        if count > 1 and not settings.REDIS_URL:
            raise CommandError(
                f"--routers {count} needs REDIS_URL: the router processes share prefix "
                "knowledge, load and admission limits through Redis. Set REDIS_URL, or run "
                "one router (--routers 1)."
            )
        return count

    def _child_env(self, *, demo: bool) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if demo and settings.CONTROLPANEL_ACCESS_LOG and "CONTROLPANEL_ACCESS_LOG_FILE" not in env:
            # The demo client's requests would be most of the console: their JSON lines go
            # to a file, and the console keeps the operators' events (registry.events).
            env["CONTROLPANEL_ACCESS_LOG_FILE"] = str(settings.VAR_DIR / "access.log")
            self.access_log = env["CONTROLPANEL_ACCESS_LOG_FILE"]
        # The launcher runs from this checkout, wherever serve was started from.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(settings.BASE_DIR), os.environ.get("PYTHONPATH")) if p
        )
        if demo and not settings.CONTROLPANEL_WORKER_TOKEN:
            # The demo's agents need a worker token; one made for this run only keeps
            # the agent API closed to anyone else.
            env["CONTROLPANEL_WORKER_TOKEN"] = secrets.token_urlsafe(24)
        return env

    def _announce(self, host: str, port: int, routers: int) -> str:
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        base = f"http://{shown_host}:{port}"
        password = accounts.admin_bootstrap()
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
        if routers > 1:
            self.stdout.write(f"Routers: {routers} processes share port {port}.\n")
        if self.access_log:
            self.stdout.write(f"Access log (JSON, one line per request): {self.access_log}\n")
        return base

    def _demo_children(self, options: dict[str, Any], base: str) -> Children:
        python, manage = sys.executable, str(settings.BASE_DIR / "manage.py")
        children: Children = []
        first = options["demo_base_port"] or DEMO_BASE_PORT
        http_ports = [first + index for index in range(options["demo"])]
        # Each engine publishes its KV cache events, as vLLM with --kv-events-config, and
        # keeps a replay socket: the worker pages show the routers' streams, and kv_aware
        # routes on them. The ports after the HTTP ones when they are free (a fixed range is
        # not taken meanwhile by some connection's ephemeral port), else any free ones.
        kv_ports = _demo_kv_ports(http_ports)
        for index, port in enumerate(http_ports):
            events, replay = kv_ports[2 * index], kv_ports[2 * index + 1]
            model, loras = DEMO_MODELS[index % len(DEMO_MODELS)]
            simulator = [python, manage, "simulate_vllm", "--port", str(port), "--model", model,
                         "--ttft-ms", "60", "--itl-ms", "25", "--max-batch", "4",
                         "--gpus", str(DEMO_GPUS[index % len(DEMO_GPUS)]),
                         "--kv-events-port", str(events),
                         "--kv-events-replay-port", str(replay)]  # fmt: skip
            for lora in loras:
                simulator += ["--lora", lora]
            children.append((f"sim-{index + 1}", simulator, False))
            children.append(
                (f"agent-{index + 1}",
                 [python, manage, "worker_agent", "--controller", base,
                  "--worker-url", f"http://127.0.0.1:{port}", "--name", f"demo-{index + 1}",
                  "--interval", "2", "--dcgm-url", f"http://127.0.0.1:{port}/dcgm-metrics",
                  "--kv-events", f"tcp://127.0.0.1:{events}",
                  "--kv-events-replay", f"tcp://127.0.0.1:{replay}"],
                 True),  # it registers with the router: once that answers
            )  # fmt: skip
        rps = DEMO_TRAFFIC_RPS if options["demo_traffic"] is None else options["demo_traffic"]
        if rps > 0:
            children.append(
                ("demo-traffic",
                 [python, "-m", "simulator.demo_traffic", "--url", base, "--rps", str(rps)],
                 True),
            )  # fmt: skip
        self.stdout.write(f"Demo: {options['demo']} simulated workers join through agents.\n")
        return children

    def _demo_alias(self) -> None:
        if not Alias.objects.filter(name=DEMO_ALIAS).exists():
            # Something for the rollouts page: try moving `chat` from llama to qwen.
            aliases.alias_create(
                name=DEMO_ALIAS,
                targets={DEMO_MODELS[0][0]: 100},
                description="demo alias: plan a rollout to qwen2.5-7b-instruct",
                actor="demo",
            )

    def _launch(
        self,
        options: dict[str, Any],
        routers: int,
        children: Children,
        env: dict[str, str],
        extra: list[str],
    ) -> None:
        """Become the launcher (same pid): it binds the port and runs every child, and none
        of Django's memory stays behind in the supervisor. `extra`: launcher arguments
        as they are (the real demo's)."""
        command = [sys.executable, "-m", "launcher", "--routers", str(routers),
                   "--host", options["host"], "--port", str(options["port"]),
                   "--grace", str(settings.ROUTER_SHUTDOWN_GRACE),
                   "--ready-path", "/health"]  # fmt: skip
        for name, argv, waits in children:
            command += ["--ready-child" if waits else "--child", name, shlex.join(argv)]
        command += extra
        connections.close_all()
        self.stdout.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, command, env)


def _demo_kv_ports(http_ports: list[int]) -> list[int]:
    """Two ports per engine: the run right after `http_ports` if all are free."""
    count = 2 * len(http_ports)
    after = list(range(http_ports[-1] + 1, http_ports[-1] + 1 + count))
    if all(_is_free(port) for port in after):
        return after
    return _free_ports(count, avoid=set(http_ports))


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int, avoid: set[int]) -> list[int]:
    """`count` distinct free ports, none in `avoid`: every socket stays bound until all are
    chosen (a port asked for twice, one socket at a time, can come back twice, and an
    engine then fails to bind its replay socket and stops the whole demo)."""
    held: list[socket.socket] = []
    chosen: list[int] = []
    try:
        while len(chosen) < count:
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in avoid:
                chosen.append(port)
        return chosen
    finally:
        for sock in held:
            sock.close()
