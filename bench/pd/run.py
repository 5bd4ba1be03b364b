"""Prefill/decode disaggregation against colocation (issue 28): does taking the long prompts'
prefills off the workers that decode keep chat's tokens flowing?

Set-ups, four simulated vLLM workers each, the same timing for all, prefill interference on
(``simulator.engine``: while prompts prefill on an engine, each of its decode tokens takes
``--prefill-interference-ms-per-block`` ms more per prefilling block; ``bench/pd/fleet.py``):

* ``colocated``: 4 workers of role ``both``;
* ``2p2d``: 2 ``prefill`` + 2 ``decode`` workers, the model's default bypass (256 tokens:
  chat's short prompts go straight to a decode worker, long prompts take the prefill leg);
* ``2p2d-nobypass``: the same workers with ``pd_bypass_tokens`` 0 (every prompt prefilled on
  a prefill worker, then transferred);
* ``1p3d``: 1 ``prefill`` + 3 ``decode`` workers, default bypass.

One router (default policy) serves them all, each set-up under a model of its own. Load
(``bench/pd/workload.py``): closed-loop streamed chat sessions mixed with long-prompt clients.
Per class (chat, long): TTFT and inter-token latency (ITL: gaps between content chunks as the
client receives them) p50 and p99, and throughput (requests/s, output tokens/s). Every run
starts from cold caches; the case order rotates from round to round; the report gives
medians over rounds and same-round ratios against colocated, with the machine's cores and
load (the machine may be shared).

Not modelled by the simulator, so not measured here: a prefill worker's limited prefill
throughput (prompts prefill side by side without slowing each other, so one prefill worker
never becomes a queue), and the token budget of a step.

Usage: ``.venv/bin/python -m bench.pd [--quick] [--rounds N] [--duration S] [--only CASE]``.
Prints markdown on stdout (progress on stderr), writes ``bench/out/pd-<timestamp>.json``;
exit 1 if any request failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import aiohttp

from bench.common.output import log, machine_info, write_json
from bench.pd import fleet as pf
from bench.pd import workload as wl
from bench.pd.report import markdown, medians, run_figures
from harness.fleet import Fleet, run_with_fleet
from harness.procfs import machine_ticks

# case -> (layout, bypass threshold; None: the model is not disaggregated)
CASES: dict[str, tuple[pf.Layout, int | None]] = {
    "colocated": (pf.COLOCATED, None),
    "2p2d": (pf.PD_2_2, pf.DEFAULT_BYPASS),
    "2p2d-nobypass": (pf.PD_2_2, 0),
    "1p3d": (pf.PD_1_3, pf.DEFAULT_BYPASS),
}
# (rounds, seconds of load per run, seconds of warm-up not measured)
FULL = (3, 20.0, 3.0)
QUICK = (1, 10.0, 2.0)


async def run_case(
    ctx: dict[str, Any], case: str, rnd: int, duration: float, warmup: float
) -> dict[str, Any]:
    proc, running, http = ctx["proc"], ctx["running"], ctx["http"]
    layout, bypass = CASES[case]
    urls = running.workers[layout.name]
    proc.check_alive()
    await pf.reset(http, urls)
    if bypass is not None:
        await pf.set_bypass(http, proc, running.router, layout.model, bypass)
    ticks0 = machine_ticks()
    samples, start, stop = await wl.run_load(
        running.router, layout.model, duration, wl.SEED + rnd, f"r{rnd}-{case}"
    )
    busy1, total1 = machine_ticks()
    figures = run_figures(samples, start, stop, warmup)
    received = []
    for url in urls:
        async with http.get(f"{url}/sim/stats") as r:
            received.append((await r.json())["received"])
    run = {
        "case": case,
        "round": rnd,
        "roles": list(layout.roles),
        "bypass_tokens": bypass,
        "per_worker_received": received,
        "machine_busy_pct": 100 * (busy1 - ticks0[0]) / max(1, total1 - ticks0[1]),
        "loadavg_after": os.getloadavg(),
        **figures,
    }
    c, g = run["chat"], run["long"]
    log(
        f"  r{rnd + 1} {case:<14} chat TTFT {c['ttft_p50_ms']:5.0f}/{c['ttft_p99_ms']:5.0f} "
        f"ITL {c['itl_p50_ms']:5.1f}/{c['itl_p99_ms']:6.1f} | long TTFT "
        f"{g['ttft_p50_ms']:5.0f}/{g['ttft_p99_ms']:5.0f} ITL {g['itl_p50_ms']:5.1f}/"
        f"{g['itl_p99_ms']:6.1f} | {run['req_s']:.1f} req/s {run['tok_s']:.0f} tok/s | "
        f"workers {received} | busy {run['machine_busy_pct']:.0f} % | errors {run['errors']}"
    )
    return run


async def benchmark(args: argparse.Namespace, proc: Fleet) -> dict[str, Any]:
    t0 = time.monotonic()
    loadavg = os.getloadavg()
    scale_rounds, scale_duration, scale_warmup = QUICK if args.quick else FULL
    rounds: int = args.rounds or scale_rounds
    duration: float = args.duration or scale_duration
    warmup = min(scale_warmup, duration / 4)
    cases = args.only or list(CASES)
    layouts = list(dict.fromkeys(CASES[c][0] for c in cases))
    log(f"starting {sum(len(x.roles) for x in layouts)} simulated workers and the router ...")
    running = await pf.start(proc, layouts)
    runs = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        ctx = {"proc": proc, "running": running, "http": http}
        for rnd in range(rounds):
            order = cases[rnd % len(cases) :] + cases[: rnd % len(cases)]
            log(f"round {rnd + 1}/{rounds}: {', '.join(order)}")
            for case in order:
                runs.append(await run_case(ctx, case, rnd, duration, warmup))
    return {
        "quick": args.quick,
        "rounds": rounds,
        "machine": machine_info(),
        "loadavg_before": loadavg,
        "setup": {
            "duration_s": duration,
            "warmup_s": warmup,
            "ttft_ms": pf.TTFT_MS,
            "prefill_ms_per_block": pf.PREFILL_MS_PER_BLOCK,
            "itl_ms": pf.ITL_MS,
            "interference_ms_per_block": pf.INTERFERENCE_MS_PER_BLOCK,
            "kv_transfer_ms_per_block": pf.KV_TRANSFER_MS_PER_BLOCK,
            "chat_clients": wl.CHAT_CLIENTS,
            "long_clients": wl.LONG_CLIENTS,
        },
        "runs": runs,
        "medians": medians(runs),
        "wall_s": time.monotonic() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 10 s per case")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 3, quick 1)")
    parser.add_argument("--duration", type=float, default=0, help="seconds of load per run")
    parser.add_argument(
        "--only", action="append", choices=list(CASES), help="run only this case (repeatable)"
    )
    args = parser.parse_args(argv)

    async def go(proc: Fleet) -> dict[str, Any]:
        return await benchmark(args, proc)

    result = run_with_fleet(go)
    if result is None:
        return 130
    path = write_json("pd", result)
    print(markdown(result))
    log(f"wrote {path}")
    errors = sum(r["errors"] for r in result["runs"])
    if errors:
        log(f"{errors} request(s) failed")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
