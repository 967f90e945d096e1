"""The machine's processes as /proc shows them, for the benchmarks that weigh a cluster (memory, CPU):
who is whose child, which is the chat service, a process's CPU time and memory figures, and how busy
the machine's cores were."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    name: str  # /proc/<pid>/comm: "postgres", "python", ...
    argv: tuple[bytes, ...]
    cpu: float = 0.0  # CPU seconds it has used so far (utime + stime)
    started: int = 0  # clock ticks after boot it started at: a pid used again is another process

    @property
    def is_task_cluster(self) -> bool:
        """`manage.py worker` serving the task queue, or one of its forked processes (they keep its argv)."""
        return b"manage.py" in self.argv and b"worker" in self.argv and not self.is_chat_service

    @property
    def is_chat_service(self) -> bool:
        """`manage.py worker --queue chat`, or one of its forked processes (they keep its argv)."""
        return b"manage.py" in self.argv and b"--queue" in self.argv and b"chat" in self.argv


def processes() -> list[Proc]:
    """Every process on the machine (one that ends while it is read is left out)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # comm sits in parentheses and may hold spaces or parentheses itself: split at the last ")".
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        found.append(Proc(int(entry.name), int(fields[1]), name, tuple(argv),
                          cpu=(int(fields[11]) + int(fields[12])) / TICKS, started=int(fields[19])))
    return found


def machine_busy() -> tuple[float, float]:
    """CPU seconds the machine's cores have been busy so far, and in all (every state but idle and iowait
    counts as busy: /proc/stat's first line)."""
    # user, nice, system, idle, iowait, irq, softirq, steal (guest time is counted in user and nice already)
    ticks = [int(n) for n in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICKS, sum(ticks) / TICKS


def descendants(root: int, procs: list[Proc]) -> list[int]:
    """Pids of `root`'s children, their children, and so on."""
    children: dict[int, list[int]] = defaultdict(list)
    for proc in procs:
        children[proc.ppid].append(proc.pid)
    found, frontier = [], [root]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


def status_kb(pid: int, field: str) -> int | None:
    """A kB figure (VmRSS, VmHWM) of /proc/<pid>/status; None when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def pss_kb(pid: int) -> int:
    """Proportional set size (pages shared by forked processes counted once overall), from smaps_rollup."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        return 0
    return 0
