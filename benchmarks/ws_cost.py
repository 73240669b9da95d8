"""The gateway's cost per WebSocket student, and the load simulator's own: N simulated students
(`streamserver loadsim`, its defaults) against one `streamserver gateway` (its defaults: captions
`auto`), recognition in a worker of its own so that it is not counted.

    flock /tmp/cpu-bench.lock .venv/bin/python -m benchmarks.ws_cost --students 100 \\
        --tree new=. --tree old=/tmp/old --rounds 2 --out benchmarks/results/ws-cost.json

Each --tree LABEL=DIR is a checkout whose gateway and simulator are measured (cwd DIR: its
package wins over the editable install); the trees take turns, round after round, against one
redis-server and one worker, so that what the machine does meanwhile falls on all of them alike.
The CPU of the gateway and of the simulator (its processes and their children) is read from
/proc over a window that opens once the joins are over and closes before the streams end; the
cost per student-second divides by the students seated times the window. After each run the
simulator's own report says what was lost or transcribed twice, counted against what its
students said. Every run is appended to --out with its date.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cpu_use import CpuSampler
from benchmarks.scaleout import _wait_http
from tests.redis_server import RedisServer, free_port

EXE = [sys.executable, "-m", "streamserver"]
JOIN_S = 8.0  # from the simulator's start until the window opens: joins, then a settled class
TAIL_S = 4.0  # between the window's end and the streams' end


def one_run(label: str, tree: Path, n: int, duration_s: float, rooms: int, speak_ratio: float, redis_url: str,
            env: dict, logs: Path, sim_args: list[str]) -> dict:
    port = free_port()
    gateway = subprocess.Popen(EXE + ["gateway", "--port", str(port), "--redis-url", redis_url], cwd=tree, env=env,
                               stdout=open(logs / f"gateway-{label}-{n}.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    report = Path(tempfile.mkdtemp(prefix=f"ws-cost-{label}-"))
    try:
        _wait_http(url + "/readyz", 60, "gateway", gateway)
        sim = subprocess.Popen(EXE + ["loadsim", "--url", url, "--students", str(n), "--duration", str(duration_s),
                                      "--rooms", str(rooms), "--speak-ratio", str(speak_ratio), "--report", str(report), *sim_args],
                               cwd=tree, env=env, stdout=open(logs / f"loadsim-{label}-{n}.log", "w"),
                               stderr=subprocess.STDOUT)
        time.sleep(JOIN_S)
        sampler = CpuSampler({"gateway": gateway.pid, "loadsim": sim.pid}, period_s=0.5)
        sampler.start()
        window = duration_s - JOIN_S - TAIL_S
        time.sleep(window)
        sampler.stop()
        cpu = sampler.summary()
        rc = sim.wait(duration_s + 120)
    finally:
        gateway.terminate()
        gateway.wait(10)
    sim_report = json.loads((report / "report.json").read_text())
    seated = sim_report["max_students_connected"]
    student_s = seated * cpu["wall_s"]
    cpu_s = cpu["cpu_s_by_kind"]  # not cores (two decimals): 0.01 of a core is 0.1 ms per student-second at 100
    return {
        "label": label, "students": n, "seated": seated, "busy": sim_report["busy_rejections"],
        "window_s": cpu["wall_s"],
        "gateway_cpu_ms_per_student_s": round(cpu_s.get("gateway", 0.0) * 1000 / student_s, 3),
        "simulator_cpu_ms_per_student_s": round(cpu_s.get("loadsim", 0.0) * 1000 / student_s, 3),
        "gateway_kernel_share": cpu["kernel_share_by_kind"].get("gateway"),
        "host_busy_share": cpu["host_busy_share"],
        "frame_ms": sim_report["frame_ms"],
        "utterances_sent": sim_report["utterances_sent"], "transcripts": sim_report["transcripts_received"],
        "lost": sim_report["lost"], "duplicates": sim_report["duplicates"], "copies": sim_report["copies"],
        "reconnects": sim_report["reconnects"],
        "finals_s": sim_report["latency_s"], "first_caption_s": sim_report.get("partial_first_s"),
        "loadsim_exit": rc,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--students", type=int, nargs="+", default=[100])
    p.add_argument("--duration", type=float, default=45.0, help="each run's class, seconds")
    p.add_argument("--rooms", type=int, default=4)
    p.add_argument("--speak-ratio", type=float, default=0.1)
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                   help="a checkout to measure (default: this one, as 'here')")
    p.add_argument("--sim-args", action="append", default=[], metavar="LABEL=ARGS",
                   help="more loadsim arguments for one tree's runs (e.g. a frame length to compare)")
    p.add_argument("--rounds", type=int, default=1, help="each tree this many times, taking turns")
    p.add_argument("--out", type=Path, required=True, help="JSON list the runs are appended to")
    p.add_argument("--logs", type=Path, help="the processes' logs (default: a temporary folder)")
    args = p.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree] or [("here", Path.cwd())]
    sim_args = {a.split("=", 1)[0]: a.split("=", 1)[1].split() for a in args.sim_args}
    if args.duration < JOIN_S + TAIL_S + 10:
        p.error(f"--duration must be at least {JOIN_S + TAIL_S + 10:g} s")

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STREAMSERVER_SECRET": secrets.token_hex(32)}
    env.setdefault("STREAMSERVER_ADMIN_TOKEN", "ws-cost-admin")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="ws-cost-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    with RedisServer() as redis:
        mport = free_port()
        worker = subprocess.Popen(EXE + ["worker", "--redis-url", redis.url, "--model", "tiny.en", "--threads", "1",
                                         "--metrics-port", str(mport)],
                                  env=env, stdout=open(logs / "worker.log", "w"), stderr=subprocess.STDOUT)
        try:
            _wait_http(f"http://127.0.0.1:{mport}/readyz", 180, "worker", worker)
            for _ in range(args.rounds):
                for n in args.students:
                    for label, tree in trees:
                        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                text=True, cwd=tree).stdout.strip()
                        result = one_run(label, tree, n, args.duration, args.rooms, args.speak_ratio, redis.url, env, logs,
                                         sim_args.get(label, []))
                        result.update(commit=commit, sim_args=" ".join(sim_args.get(label, [])), cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M"))
                        print(json.dumps(result), flush=True)
                        results.append(result)
        finally:
            worker.terminate()
            worker.wait(10)
    old = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(old + results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
