"""What reading one worker's /metrics page costs the probe, the way it read it before and now.

The pages are real vLLM 0.32's (tests/data/vllm-captures/metrics-tiny.txt, and
../shared/vllm-captures/metrics-smollm2.txt when that folder is there, about 700 lines each).
Three ways, each the CPU time per page (``time.process_time``), median of 5 repetitions of
50 reads:

* **whole page, prometheus_client**: how the probe parsed before (#29);
* **vllm lines, prometheus_client**: only the `vllm:` families without creation times
  (``routing.telemetry.vllm_metrics.vllm_text``);
* **the probe now**: ``controlpanel.fleet.probes.parse_scrape`` (those lines through the fast
  reader ``routing.telemetry.prom_text``, the readings and the kept series).

``python -m bench.probe_parse``. Prints the machine first.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench.common.output import log, machine_info

ROOT = Path(__file__).resolve().parents[2]
PAGES = {
    "real vLLM 0.32, tiny Llama": ROOT / "tests/data/vllm-captures/metrics-tiny.txt",
    "real vLLM 0.32, SmolLM2": ROOT.parent / "shared/vllm-captures/metrics-smollm2.txt",
}
REPEATS, READS = 5, 50


def parse_whole(text: str) -> list[object]:
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


def per_page_ms(read: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.process_time()
        for _ in range(READS):
            read()
        times.append((time.process_time() - started) / READS * 1000)
    return statistics.median(times)


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")
    import django

    django.setup()
    from controlpanel.fleet import probes
    from routing.telemetry.vllm_metrics import vllm_text

    print("machine:", machine_info())
    print("| page | lines | whole page, prometheus_client ms | vllm lines, prometheus_client ms "
          "| the probe now ms | before / now |")  # fmt: skip
    print("|---|--:|--:|--:|--:|--:|")
    for name, path in PAGES.items():
        if not path.exists():
            log(f"{name}: {path} not here, left out")
            continue
        text = path.read_text()
        whole = per_page_ms(partial(parse_whole, text))
        lines = per_page_ms(partial(parse_whole, vllm_text(text)))
        now = per_page_ms(partial(probes.parse_scrape, text))
        print(f"| {name} | {text.count(chr(10))} | {whole:.2f} | {lines:.2f} | {now:.2f} "
              f"| {whole / now:.1f}x |")  # fmt: skip
    return 0
