"""Where a benchmark host's CPU went: the whole host's busy share, and the cores each role
(gateways, workers, Redis, the load simulator) used, read from /proc (Linux only).

A latency tail on a shared host is often only CPU contention: the simulated students run on the
same cores as the server. This says whether the host was saturated, and by whom; and whether the
time went to the programs or to the kernel for them (system time, page faults), or to the
hypervisor (steal: time the virtual machine's CPUs were ready but not run), which tells a slow
host from a slow program.

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
from typing import NamedTuple

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Use(NamedTuple):
    """What a process had used so far: CPU seconds in its own code and in the kernel, and page
    faults (minor: a page mapped without reading it from disk; major: read from disk)."""

    user_s: float = 0.0
    system_s: float = 0.0
    minor_faults: int = 0
    major_faults: int = 0

    def __sub__(self, other: "Use") -> "Use":  # type: ignore[override]
        return Use(*(a - b for a, b in zip(self, other)))

    def __add__(self, other: "Use") -> "Use":  # type: ignore[override]
        return Use(*(a + b for a, b in zip(self, other)))


def _stat(pid: int) -> tuple[int, Use] | None:
    """(parent pid, what it used so far) of a live process."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # proc(5), counting from the field after the command: ppid 1, minflt 7, majflt 9, utime 11, stime 12
    return int(f[1]), Use(int(f[11]) / TICKS, int(f[12]) / TICKS, int(f[7]), int(f[9]))


HOST_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _host_times() -> list[float]:
    """The whole host's jiffies since boot, by HOST_FIELDS (0 for those an old kernel lacks)."""
    values = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (values + [0.0] * len(HOST_FIELDS))[: len(HOST_FIELDS)]


class CpuSampler:
    def __init__(self, roles: dict[str, int | None], period_s: float = 1.0) -> None:
        self.roles, self.period_s = {k: v for k, v in roles.items() if v}, period_s
        self._first: dict[int, Use] = {}  # pid -> its use when first seen
        self._last: dict[int, tuple[str, Use]] = {}  # pid -> (role, its use when last seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._started: tuple[float, list[float]] = (0.0, [0.0] * len(HOST_FIELDS))
        self._host = self._started

    def add(self, role: str, pid: int) -> None:
        self.roles[role] = pid

    def start(self) -> None:
        self._started = (time.monotonic(), _host_times())
        self._sample(first=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self._host = (time.monotonic(), _host_times())

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

        for pid, (_ppid, use) in stats.items():
            if (name := role(pid)) is None:
                continue
            # A process first seen after the start counts from 0: its whole life was in the run.
            self._first.setdefault(pid, use if first else Use())
            self._last[pid] = (name, use)

    def summary(self) -> dict:
        """cores: CPU seconds / wall seconds, by role and summed by kind (the text before "-"), and
        the CPU seconds by kind;
        per kind also the share of its CPU time spent in the kernel and its page faults a second;
        the host's busy share and, of all its CPU time, the shares of system and steal time."""
        (t0, host0), (t1, host1) = self._started, self._host
        wall = max(t1 - t0, 1e-9)
        by_role: dict[str, Use] = {}
        for pid, (name, use) in self._last.items():
            by_role[name] = by_role.get(name, Use()) + (use - self._first.get(pid, Use()))
        by_kind: dict[str, Use] = {}
        for name, use in by_role.items():
            by_kind[name.split("-")[0]] = by_kind.get(name.split("-")[0], Use()) + use
        host = dict(zip(HOST_FIELDS, (b - a for a, b in zip(host0, host1))))
        total = max(sum(host.values()), 1.0)

        def cores(u: Use) -> float:
            return round((u.user_s + u.system_s) / wall, 2)

        return {
            "wall_s": round(wall, 1),
            "host_cpus": os.cpu_count(),
            "host_busy_share": round(1 - (host["idle"] + host["iowait"]) / total, 3),
            "host_system_share": round((host["system"] + host["irq"] + host["softirq"]) / total, 3),
            "host_steal_share": round(host["steal"] / total, 3),
            "cores_by_kind": {k: cores(u) for k, u in sorted(by_kind.items())},
            # unrounded beside cores: a figure per student divides it by many students
            "cpu_s_by_kind": {k: round(u.user_s + u.system_s, 3) for k, u in sorted(by_kind.items())},
            "kernel_share_by_kind": {k: round(u.system_s / max(u.user_s + u.system_s, 1e-9), 3) for k, u in sorted(by_kind.items())},
            "page_faults_per_s_by_kind": {k: {"minor": round(u.minor_faults / wall), "major": round(u.major_faults / wall, 1)}
                                          for k, u in sorted(by_kind.items())},
            "cores_by_process": {k: cores(u) for k, u in sorted(by_role.items())},
        }
