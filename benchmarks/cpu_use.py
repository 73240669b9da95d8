"""Where a benchmark host's CPU went: the whole host's busy share, and the cores each role
(gateways, workers, Redis, the load simulator) used, read from /proc (Linux only).

A latency tail on a shared host is often only CPU contention: the simulated students run on the
same cores as the server. This says whether the host was saturated, and by whom.

    sampler = CpuSampler({"gateway-0": pid, ..., "loadsim": pid}); sampler.start()
    ...; sampler.stop(); report["cpu"] = sampler.summary()

A role's processes are its pid and every descendant (the simulator's student processes); the
CPU time of a process is sampled every `period_s`, so a process that lived less than a period
(or the last part of one that exited between samples) is missed: the figures are lower bounds.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds so far) of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS  # ppid; utime + stime


def _host_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole host since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return float(sum(values) - idle), float(sum(values))


class CpuSampler:
    def __init__(self, roles: dict[str, int | None], period_s: float = 1.0) -> None:
        self.roles, self.period_s = {k: v for k, v in roles.items() if v}, period_s
        self._first: dict[int, float] = {}  # pid -> CPU seconds when first seen
        self._last: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds when last seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._started = self._host = (0.0, (0.0, 0.0))

    def add(self, role: str, pid: int) -> None:
        self.roles[role] = pid

    def start(self) -> None:
        self._started = (time.monotonic(), _host_busy())
        self._sample(first=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self._host = (time.monotonic(), _host_busy())

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def _sample(self, first: bool = False) -> None:
        stats = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None:
                stats[int(entry.name)] = s
        role_of = {pid: role for role, pid in self.roles.items()}

        def role(pid: int) -> str | None:
            seen = 0
            while pid > 1 and seen < 64:  # up the parent chain to a role's process
                if pid in role_of:
                    return role_of[pid]
                pid, seen = stats[pid][0] if pid in stats else 0, seen + 1
            return None

        for pid, (_ppid, cpu) in stats.items():
            if (name := role(pid)) is None:
                continue
            # A process first seen after the start counts from 0: its whole life was in the run.
            self._first.setdefault(pid, cpu if first else 0.0)
            self._last[pid] = (name, cpu)

    def summary(self) -> dict:
        """cores: CPU seconds / wall seconds, by role and summed by kind (the text before "-")."""
        (t0, (busy0, total0)), (t1, (busy1, total1)) = self._started, self._host
        wall = max(t1 - t0, 1e-9)
        by_role: dict[str, float] = {}
        for pid, (name, cpu) in self._last.items():
            by_role[name] = by_role.get(name, 0.0) + cpu - self._first.get(pid, 0.0)
        by_kind: dict[str, float] = {}
        for name, seconds in by_role.items():
            by_kind[name.split("-")[0]] = by_kind.get(name.split("-")[0], 0.0) + seconds
        return {
            "wall_s": round(wall, 1),
            "host_cpus": os.cpu_count(),
            "host_busy_share": round((busy1 - busy0) / max(total1 - total0, 1.0), 3),
            "cores_by_kind": {k: round(v / wall, 2) for k, v in sorted(by_kind.items())},
            "cores_by_process": {k: round(v / wall, 2) for k, v in sorted(by_role.items())},
        }
