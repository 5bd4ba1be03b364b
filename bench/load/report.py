"""The markdown report of ``bench.load`` and its PASS/FAIL checks.

A library for that script, not a script: :func:`report` turns the result (the JSON the script
writes) into the markdown it prints: machine and set-up, the figures table, the router's
sockets before the run, after the settle and once the upstream pool is idle, and the checks;
:func:`passed` is also what the exit status is decided by.
"""

from __future__ import annotations

from typing import Any

from bench.load.fleet import N_WORKERS, max_batch


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def sockets_line(label: str, s: dict[str, int]) -> str:
    other = {k: v for k, v in s.items() if k.startswith("tcp_") and k != "tcp_established"}
    extra = ", ".join(f"{k.removeprefix('tcp_')} {v}" for k, v in other.items())
    return (
        f"| {label} | {s['fds']} | {s['sockets']} | {s['tcp_established']} "
        f"| {s['established_from_clients']} | {s['established_to_workers']} "
        f"| {s['established_other']} | {s.get('non_tcp', 0)} | {extra or '-'} |"
    )


def passed(result: dict[str, Any]) -> dict[str, bool]:
    r = result["router"]
    return {
        "no errors": result["load"]["errors"] == 0,
        "in-flight back to 0": r["inflight_after"] == 0,
        "no client connection left": r["sockets_after"]["established_from_clients"] == 0,
        "upstream pool empties when idle": r["pool_emptied_after_s"] is not None,
    }


def report(result: dict[str, Any]) -> str:
    m, cfg, load, r = result["machine"], result["config"], result["load"], result["router"]
    cpu = load["cpu"]
    la0, la1 = result["loadavg_before"], result["loadavg_end"]
    lines = [
        f"## Load — {m['date']}",
        "",
        f"Machine: {m['nproc']} cores, {m['cpu_model']}, Python {m['python']}, aiohttp "
        f"{m['aiohttp']}, kernel {m['kernel']}. Load average before "
        f"{la0[0]:.2f} / {la0[1]:.2f} / {la0[2]:.2f}, after the run "
        f"{la1[0]:.2f} / {la1[1]:.2f} / {la1[2]:.2f}.",
        f"{cfg['clients']} streaming clients for {cfg['seconds']:g} s through the router to "
        f"{N_WORKERS} simulated workers (ttft {cfg['ttft_ms']:g} ms, itl {cfg['itl_ms']:g} ms, "
        f"{cfg['max_tokens']} tokens, max batch {max_batch(cfg['clients'])}); open-file limit "
        f"{cfg['nofile']['soft']} (router {r['nofile_limit']}).",
        "",
        "| figure | value |",
        "|---|--:|",
        f"| streams completed | {load['completed']} |",
        f"| errors | {load['errors']} |",
        f"| streams/s (nominal without CPU limits) | {load['streams_per_s']:.0f} "
        f"({load['nominal_streams_per_s']:.0f}) |",
        f"| TTFT p50 / p99 / max ms | {fmt(load['ttft_p50_ms'])} / {fmt(load['ttft_p99_ms'])} "
        f"/ {fmt(load['ttft_max_ms'])} |",
        f"| router RSS start / end / peak (VmHWM) MiB | {r['rss_start_mib']:.1f} / "
        f"{r['rss_end_mib']:.1f} / {r['hwm_mib']:.1f} |",
        f"| router RSS once the upstream pool is idle MiB | {r['rss_idle_mib']:.1f} |",
        f"| router in-flight afterwards | {r['inflight_after']} |",
        f"| CPU cores used: router / workers / load generator | {cpu['router_cores']:.2f} / "
        f"{cpu['workers_cores']:.2f} / {cpu['client_cores']:.2f} |",
        f"| machine busy % (cores used by other processes) | {cpu['machine_busy_pct']:.0f} "
        f"({cpu['other_cores']:.2f}) |",
        f"| load generator loop lag p50 / p99 ms | {fmt(load['client_loop_lag_p50_ms'])} / "
        f"{fmt(load['client_loop_lag_p99_ms'])} |",
        "",
        "Router sockets (`/proc/<pid>/fd`, TCP by inode in `/proc/<pid>/net/tcp{,6}`):",
        "",
        "| when | fds | sockets | TCP established | from clients | to workers | other "
        "| non-TCP | other TCP states |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|",
        sockets_line("before the run", r["sockets_before"]),
        sockets_line(f"{cfg['settle']:g} s after the clients finished", r["sockets_after"]),
    ]
    emptied = r["pool_emptied_after_s"]
    idle_label = (
        f"{emptied:.0f} s later, pool empty"
        if emptied is not None
        else f"{cfg['idle_wait']:g} s later, pool NOT empty"
    )
    lines += [sockets_line(idle_label, r["sockets_after_idle"]), ""]
    lines += ["| check | result |", "|---|:-:|"]
    lines += [f"| {name} | {'PASS' if ok else 'FAIL'} |" for name, ok in passed(result).items()]
    if load["errors_by_cause"]:
        lines += ["", "Errors by cause:", ""]
        lines += [f"* {n} x {cause}" for cause, n in load["errors_by_cause"].items()]
    return "\n".join(lines)
