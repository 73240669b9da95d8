"""benchmarks/cpu_use.py on real processes: a role's CPU time, its kernel share and page faults."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.cpu_use import CpuSampler

# A child whose child (a descendant counts for its role) spins for 1 s in Python, then touches
# 64 MB of new memory page by page: user time, then page faults and kernel time.
BUSY = """
import subprocess, sys, time
code = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.0: pass\\nb = bytearray(64 << 20)\\nb[::4096] = b'x' * (64 << 8)"
subprocess.run([sys.executable, "-c", code], check=True)
time.sleep(0.3)
"""


def test_a_role_is_its_process_and_descendants_with_their_kernel_time_and_page_faults():
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    sampler = CpuSampler({"worker-0": proc.pid}, period_s=0.05)
    sampler.start()
    proc.wait(30)
    sampler.stop()
    s = sampler.summary()
    assert s["cores_by_process"]["worker-0"] * s["wall_s"] >= 0.8  # the grandchild's second of spinning
    assert 0 < s["kernel_share_by_kind"]["worker"] < 1
    assert s["page_faults_per_s_by_kind"]["worker"]["minor"] > 0
    assert 0 <= s["host_steal_share"] <= s["host_busy_share"] <= 1
    assert 0 <= s["host_system_share"] <= s["host_busy_share"]
