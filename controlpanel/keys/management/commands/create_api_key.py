"""`manage.py create_api_key NAME [--models a,b] [--rpm N] [--tpm N] [--priority C] [--weight W]
[--daily-tokens N] [--monthly-tokens N]`: a client key for the router, printed once; only its
hash is stored."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlpanel.keys import services as keys
from controlpanel.registry.errors import ServiceError
from routing.fleet.priority import PRIORITIES, STANDARD


class Command(BaseCommand):
    help = "Create a client API key for the router and print it (the only time it is shown)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument(
            "--models", default="", help="comma-separated models or aliases (default: all)"
        )
        parser.add_argument("--rpm", type=int, default=None, help="requests per minute")
        parser.add_argument("--tpm", type=int, default=None, help="tokens per minute")
        parser.add_argument(
            "--allow-unknown-models",
            action="store_true",
            help="keep model names nothing serves yet (else a misspelt name is refused)",
        )
        parser.add_argument(
            "--explain",
            action="store_true",
            help="may ask for X-Route-Explain (routing.telemetry.explain)",
        )
        parser.add_argument(
            "--priority", default=STANDARD, help=f"its class: {', '.join(PRIORITIES)}"
        )
        parser.add_argument("--weight", type=float, default=1.0, help="its fair-share weight")
        parser.add_argument("--daily-tokens", type=int, default=None, help="tokens per UTC day")
        parser.add_argument("--monthly-tokens", type=int, default=None, help="tokens per UTC month")

    def handle(self, *args: Any, **options: Any) -> None:
        models = [m for m in options["models"].split(",") if m.strip()]
        try:
            issued = keys.api_key_create(
                name=options["name"],
                models=models,
                rpm=options["rpm"],
                allow_unknown_models=options["allow_unknown_models"],
                can_explain=options["explain"],
                tpm=options["tpm"],
                priority=options["priority"],
                weight=options["weight"],
                daily_tokens=options["daily_tokens"],
                monthly_tokens=options["monthly_tokens"],
                actor="manage.py create_api_key",
            )
        except ServiceError as exc:
            raise CommandError(str(exc)) from exc
        # The key alone on stdout, so `KEY=$(manage.py create_api_key ci)` works; the rest
        # goes to stderr.
        self.stderr.write(
            f"Created API key #{issued.record.pk} {issued.record.name!r} "
            f"({issued.record.prefix}…). It is shown only now:"
        )
        self.stdout.write(issued.secret)
