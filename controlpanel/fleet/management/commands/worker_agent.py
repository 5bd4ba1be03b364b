import logging
import os
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlpanel.fleet.agent import Agent
from controlpanel.fleet.kv_endpoints import InvalidKvEventsEndpoint, kv_endpoints
from controlpanel.registry.choices import WorkerRole


class Command(BaseCommand):
    help = "Run beside a vLLM server: register it, heartbeat, drain it on SIGTERM."
    requires_system_checks: list[str] = []
    requires_migrations_checks = False

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--controller", required=True, help="the control panel's URL")
        parser.add_argument("--worker-url", required=True, help="the vLLM server's URL")
        parser.add_argument("--name", default="", help="display name (default: host:port)")
        parser.add_argument(
            "--interval", type=float, default=None, help="seconds between heartbeats"
        )
        parser.add_argument(
            "--dcgm-url",
            default="",
            help="this worker's DCGM exporter, e.g. http://127.0.0.1:9400/metrics (optional)",
        )
        parser.add_argument(
            "--vllm-api-key",
            default=os.environ.get("VLLM_API_KEY", ""),
            help="the key the vLLM server requires (default: $VLLM_API_KEY, as vLLM reads "
            "it); sent to the controller once, at registration, for the router to use",
        )
        parser.add_argument(
            "--kv-events",
            default=None,
            help="the server's KV cache events endpoint as routers reach it, e.g. "
            "tcp://gpu-1:5557 (vLLM's --kv-events-config endpoint). Left out, the controller "
            "reads it from the server's GET /kv_event_sources at the first registration; "
            '"" registers none',
        )
        parser.add_argument(
            "--kv-events-replay",
            default=None,
            help="its replay endpoint, e.g. tcp://gpu-1:5558 (optional; with --kv-events)",
        )
        parser.add_argument(
            "--role",
            choices=WorkerRole.values,
            default=None,
            help="the server's part in prefill/decode disaggregation: prefill (started as vLLM's "
            "kv_producer), decode (kv_consumer) or both (a whole-request server). Left out, the "
            'worker keeps the role it has ("both" when new)',
        )
        parser.add_argument(
            "--token",
            default=None,
            help="worker token (default: $CONTROLPANEL_WORKER_TOKEN)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s agent: %(message)s")
        kv_events, kv_replay = options["kv_events"], options["kv_events_replay"]
        if kv_events is None and kv_replay is not None:
            raise CommandError("--kv-events-replay needs --kv-events (the stream it replays)")
        if kv_events is not None:
            try:  # here, not as a 422 the agent would retry forever
                kv_events, kv_replay = kv_endpoints(kv_events, kv_replay or "")
            except InvalidKvEventsEndpoint as exc:
                raise CommandError(str(exc)) from exc
        agent = Agent(
            controller=options["controller"],
            worker_url=options["worker_url"],
            token=options["token"] or settings.CONTROLPANEL_WORKER_TOKEN,
            name=options["name"],
            interval=options["interval"],
            dcgm_url=options["dcgm_url"],
            vllm_api_key=options["vllm_api_key"],
            kv_events=kv_events,
            kv_events_replay=kv_replay or "",
            role=options["role"],
        )
        agent.install_signal_handlers()
        agent.run()
