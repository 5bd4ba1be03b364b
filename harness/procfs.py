"""What ``/proc`` says about a process and the machine: CPU time, memory sizes, open sockets and
TCP connections. The benchmarks read them around every run; the chaos tests read a router's
sockets. The standard library only.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
TCP_STATES = {
    "01": "established",
    "02": "syn_sent",
    "03": "syn_recv",
    "04": "fin_wait1",
    "05": "fin_wait2",
    "06": "time_wait",
    "07": "close",
    "08": "close_wait",
    "09": "last_ack",
    "0A": "listen",
    "0B": "closing",
}


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of a whole process (all its threads), in seconds."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "; field 3 is fields[0]
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant alive now (a server's supervisor and its workers)."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
    return tree


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks summed over all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]  # user .. steal
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def status_kib(pid: int, key: str) -> int:
    """A size from /proc/<pid>/status, e.g. "VmRSS" or "VmHWM", in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def tcp_table(pid: int) -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) for every TCP socket in pid's namespace."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            local, remote, state, inode = cols[1], cols[2], cols[3], int(cols[9])
            port = int(local.rsplit(":", 1)[1], 16)
            remote_port = int(remote.rsplit(":", 1)[1], 16)
            table[inode] = (port, remote_port, TCP_STATES.get(state, state))
    return table


def socket_inodes(pid: int) -> tuple[int, list[int]]:
    """(open fds, inodes of the fds that are sockets) of a process."""
    fd_dir = Path(f"/proc/{pid}/fd")
    fds = os.listdir(fd_dir)
    inodes = []
    for fd in fds:
        with contextlib.suppress(FileNotFoundError):  # closed while we looked
            target = os.readlink(fd_dir / fd)
            if target.startswith("socket:["):
                inodes.append(int(target[8:-1]))
    return len(fds), inodes
