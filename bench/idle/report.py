"""The markdown report of ``bench.idle``: CPU per process of the serve tree and the workers,
the busiest threads, the router's memory, and the target."""

from __future__ import annotations

from typing import Any

CPU_TARGET_PCT = 1.0  # the serve tree's total, % of one core, with no traffic
RSS_TARGET_MIB = 100.0  # a router process's peak
THREADS_SHOWN = 3


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| process | pid | % of a core | CPU s | RSS / peak MiB | busiest threads (% of a core) |",
        "|---|--:|--:|--:|--:|---|",
    ]
    for r in sorted(rows, key=lambda r: -r["core_pct"]):
        threads = ", ".join(
            f"{name.rsplit(':', 1)[0]} {pct:.2f}"
            for name, pct in list(r["threads_core_pct"].items())[:THREADS_SHOWN]
        )
        memory = f"{r.get('vmrss_mib', 0):.0f} / {r.get('vmhwm_mib', 0):.0f}"
        new = " (started meanwhile)" if r["new"] else ""
        lines.append(
            f"| {r['role']}{new} | {r['pid']} | {r['core_pct']:.2f} | {r['cpu_s']:.2f} "
            f"| {memory} | {threads or '-'} |"
        )
    return lines


def report(result: dict[str, Any]) -> str:
    cfg, machine = result["config"], result["machine"]
    serve_total = sum(r["core_pct"] for r in result["serve"])
    worker_total = sum(r["core_pct"] for r in result["workers"])
    routers = [r for r in result["serve"] if r["role"] == "router"]
    peak = max((r.get("vmhwm_mib", 0.0) for r in routers), default=0.0)
    redis = "with Redis" if cfg["redis_url"] else "without Redis"
    lines = [
        "# Idle serve tree",
        "",
        f"{machine['nproc']} cores ({machine['cpu_model']}), Python {machine['python']}, "
        f"{machine['date']}. `serve --routers {cfg['routers']}` {redis}, "
        f"{cfg['workers']} simulated workers registered, no traffic; settled "
        f"{cfg['settle']:.0f} s, measured {result['seconds']:.0f} s. Probes every "
        f"{cfg['probe_interval']:g} s (CONTROLPANEL_PROBE_INTERVAL): "
        f"{cfg['workers'] / cfg['probe_interval']:.1f} worker probes a second.",
        "",
        "## Serve tree",
        "",
        *table(result["serve"]),
        "",
        "## Workers (outside the tree)",
        "",
        *table(result["workers"]),
        "",
        "## Targets",
        "",
        "| figure | value | target | |",
        "|---|--:|--:|---|",
        f"| serve tree CPU, no traffic | {serve_total:.2f} % of a core | <= {CPU_TARGET_PCT:g} % "
        f"| {'PASS' if serve_total <= CPU_TARGET_PCT else 'FAIL'} |",
        f"| router peak RSS (VmHWM, idle) | {peak:.1f} MiB | <= {RSS_TARGET_MIB:.0f} MiB "
        f"| {'PASS' if peak <= RSS_TARGET_MIB else 'FAIL'} |",
        "",
        f"Workers together: {worker_total:.2f} % of a core (answering probes and their own "
        "clocks; not part of the target).",
    ]
    return "\n".join(lines)
