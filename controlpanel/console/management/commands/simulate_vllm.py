"""``manage.py simulate_vllm``: run a fake vLLM server (see the simulator package)."""

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from simulator.config import add_cli_arguments, config_from_options
from simulator.server import run_simulator


class Command(BaseCommand):
    help = "Run a simulated vLLM OpenAI-compatible server for demos, tests and benchmarks."
    # The simulator never touches the database, so it must start without one.
    requires_system_checks: tuple[str, ...] = ()
    requires_migrations_checks = False

    def add_arguments(self, parser: CommandParser) -> None:
        add_cli_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        run_simulator(config_from_options(options), options["host"], options["port"])
