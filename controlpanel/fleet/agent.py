"""The worker agent: runs beside an unmodified vLLM server and keeps it in the registry.

It registers the server, heartbeats with the queue length read from the server's own
/metrics, registers again when the controller has forgotten it (a 404 on heartbeat, as
FastChat does), and drains the server on SIGTERM so no new request is sent to it.

Each heartbeat also carries this machine's GPU readings from NVML (controlpanel.gpu), when
there is NVML to read; without it the agent logs "no GPU" once and sends no GPU block. A
`dcgm_url` given at start is registered as the worker's DCGM exporter for the probes, and
`kv_events` (with `kv_events_replay`) as the server's KV cache events endpoints, which every
router subscribes to. Without `kv_events` the controller reads them from the server (vLLM's
GET /kv_event_sources) when it first registers; "" registers none. A `role` given
("prefill", "decode" or "both") is the server's part in prefill/decode disaggregation
(routing.pd), sent at every registration; without one the worker keeps the role it has
("both" when new).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from controlpanel.fleet.gpu import NvmlReader

log = logging.getLogger(__name__)

QUEUE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def queue_length_from_metrics(text: str) -> int | None:
    """Running plus waiting requests over all models; None when the server exports neither
    (never a made-up zero)."""
    total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        if family.name in QUEUE_METRICS:
            for sample in family.samples:
                total += sample.value
                found = True
    return int(total) if found else None


class Agent:
    def __init__(
        self,
        *,
        controller: str,
        worker_url: str,
        token: str,
        name: str = "",
        interval: float | None = None,
        dcgm_url: str = "",
        nvml: NvmlReader | None = None,
        vllm_api_key: str = "",
        kv_events: str | None = None,
        kv_events_replay: str = "",
        role: str | None = None,
    ) -> None:
        self.controller = controller.rstrip("/")
        self.worker_url = worker_url.rstrip("/")
        self.name = name
        self.dcgm_url = dcgm_url
        self.vllm_api_key = vllm_api_key  # the server's --api-key, for the router to send
        self.kv_events, self.kv_events_replay = kv_events, kv_events_replay
        self.role = role  # None: the controller keeps the role the worker has
        self.nvml = nvml or NvmlReader()
        self.interval = interval
        self.worker_id: int | None = None
        self.stopping = threading.Event()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(10.0, connect=5.0))

    def run(self) -> None:
        """Until stopped: keep registered and beating; on stop, drain the worker."""
        while not self.stopping.is_set():
            try:
                self.step()
            except httpx.HTTPError as exc:
                log.warning("controller unreachable: %s", exc)
                self.stopping.wait(min(self.interval or 5.0, 5.0))
                continue
            self.stopping.wait(self.interval or 5.0)
        self.deregister()

    def step(self) -> None:
        if self.worker_id is None:
            self.register()
        else:
            self.heartbeat()

    def register(self) -> None:
        payload = {"url": self.worker_url, "name": self.name}
        if self.role is not None:
            payload["role"] = self.role
        if self.dcgm_url:
            payload["dcgm_url"] = self.dcgm_url
        if self.vllm_api_key:
            payload["api_key"] = self.vllm_api_key
        if self.kv_events is not None:  # None: the controller asks the server
            payload["kv_events"] = self.kv_events
            payload["kv_events_replay"] = self.kv_events_replay
        response = self.http.post(f"{self.controller}/api/workers/register", json=payload)
        response.raise_for_status()
        body = response.json()
        self.worker_id = int(body["id"])
        if self.interval is None:
            self.interval = float(body["heartbeat_interval"])
        log.info("registered %s as worker %s", self.worker_url, self.worker_id)

    def heartbeat(self) -> None:
        response = self.http.post(
            f"{self.controller}/api/workers/{self.worker_id}/heartbeat", json=self.beat()
        )
        if response.status_code == 404:
            log.info("the controller forgot worker %s; registering again", self.worker_id)
            self.worker_id = None
            self.register()
            return
        response.raise_for_status()

    def beat(self) -> dict[str, Any]:
        """One heartbeat's body: the queue length and, only when NVML reads, the GPUs."""
        body: dict[str, Any] = {"queue_length": self.read_queue_length()}
        gpus = self.nvml.read()
        if gpus is not None:
            body["gpus"] = gpus
        return body

    def read_queue_length(self) -> int | None:
        try:
            response = self.http.get(f"{self.worker_url}/metrics", headers={"Authorization": ""})
            response.raise_for_status()
            return queue_length_from_metrics(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("cannot read %s/metrics: %s", self.worker_url, exc)
            return None

    def deregister(self) -> None:
        if self.worker_id is None:
            return
        try:
            self.http.post(f"{self.controller}/api/workers/{self.worker_id}/deregister")
            log.info("drained worker %s on shutdown", self.worker_id)
        except httpx.HTTPError as exc:
            log.warning("could not drain worker %s on shutdown: %s", self.worker_id, exc)

    def install_signal_handlers(self) -> None:
        def stop(signum: int, frame: FrameType | None) -> None:
            self.stopping.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
