"""`manage.py create_api_key NAME [--models a,b] [--rpm N] [--tpm N]`: a client key for the
router, printed once; only its hash is stored."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlpanel import keys
from controlpanel.services import ServiceError


class Command(BaseCommand):
    help = "Create a client API key for the router and print it (the only time it is shown)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument(
            "--models", default="", help="comma-separated models or aliases (default: all)"
        )
        parser.add_argument("--rpm", type=int, default=None, help="requests per minute")
        parser.add_argument("--tpm", type=int, default=None, help="tokens per minute")

    def handle(self, *args: Any, **options: Any) -> None:
        models = [m for m in options["models"].split(",") if m.strip()]
        try:
            issued = keys.api_key_create(
                name=options["name"],
                models=models,
                rpm=options["rpm"],
                tpm=options["tpm"],
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
