"""A class on gateway + workers + Redis, simulated students over WebSocket, optionally one worker
killed with SIGKILL halfway: lost and duplicated utterances and end-of-speech -> dashboard latency.

    STREAMSERVER_ADMIN_TOKEN=... .venv/bin/python -m benchmarks.scaleout --students 100 --duration 60 \\
        --workers 2 --kill-at 30 --out benchmarks/results/scaleout-2core-kill

Starts its own redis-server (append-only), one `streamserver gateway` and N `streamserver worker`
processes, runs `streamserver loadsim` against the gateway, and writes OUT/report.json (the
simulator's report plus what was killed and when) with the simulator's plots beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.redis_server import RedisServer, free_port

EXE = [sys.executable, "-m", "streamserver"]


def _wait_http(url: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} not ready at {url} after {timeout_s:.0f}s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--students", type=int, default=100)
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--rooms", type=int, default=1)
    p.add_argument("--speak-ratio", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="per worker")
    p.add_argument("--max-batch", type=int, default=16, help="per worker")
    p.add_argument("--model", default="tiny.en")
    p.add_argument("--backend", default="onnxruntime")
    p.add_argument("--kill-at", type=float, help="SIGKILL worker 0 this many seconds into the run")
    p.add_argument("--restart-after", type=float, help="start a replacement worker this long after the kill "
                   "(what a supervisor such as docker's restart policy does)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    token = os.environ.setdefault("STREAMSERVER_ADMIN_TOKEN", "scaleout-admin")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    redis = RedisServer(persist_dir=Path(tempfile.mkdtemp(prefix="scaleout-redis-"))).start()
    procs: list[subprocess.Popen] = []
    try:
        port = free_port()
        gateway = subprocess.Popen(
            EXE + ["gateway", "--port", str(port), "--redis-url", redis.url],
            env=env, stdout=open(logs / "gateway.log", "w"), stderr=subprocess.STDOUT,
        )
        procs.append(gateway)
        def start_worker(name: str) -> tuple[subprocess.Popen, int]:
            mport = free_port()
            w = subprocess.Popen(
                EXE + ["worker", "--redis-url", redis.url, "--model", args.model, "--backend", args.backend,
                       "--threads", str(args.threads), "--max-batch", str(args.max_batch), "--name", name,
                       "--metrics-port", str(mport)],
                env=env, stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT,
            )
            procs.append(w)
            return w, mport

        workers = [start_worker(f"worker-{i}") for i in range(args.workers)]
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/healthz", 60, "gateway")
        for w, mport in workers:
            _wait_http(f"http://127.0.0.1:{mport}/readyz", 180, "worker")
        print(f"gateway {url}, {args.workers} workers ready; simulating {args.students} students", file=sys.stderr, flush=True)
        sim = subprocess.Popen(
            EXE + ["loadsim", "--url", url, "--students", str(args.students), "--duration", str(args.duration),
                   "--rooms", str(args.rooms), "--speak-ratio", str(args.speak_ratio), "--transport", "ws",
                   "--report", str(args.out)],
            env={**env, "STREAMSERVER_ADMIN_TOKEN": token},
        )
        killed = None
        started = time.time()
        if args.kill_at is not None:
            while sim.poll() is None and time.time() - started < args.kill_at:
                time.sleep(0.2)
            victim = workers[0][0]
            victim.send_signal(signal.SIGKILL)
            killed = {"worker": "worker-0", "at_s": round(time.time() - started, 1), "signal": "SIGKILL"}
            print(f"killed worker-0 at {killed['at_s']}s", file=sys.stderr, flush=True)
            if args.restart_after is not None:
                time.sleep(args.restart_after)
                start_worker("worker-0-restarted")
                killed["replacement_started_at_s"] = round(time.time() - started, 1)
        rc = sim.wait()
        report_path = args.out / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        report["scenario"] = {
            "gateways": 1, "workers": args.workers, "threads_per_worker": args.threads, "max_batch": args.max_batch, "model": args.model,
            "backend": args.backend, "ort_spin": env.get("STREAMSERVER_ORT_SPIN", "0 (the worker default)"), "killed": killed, "loadsim_exit": rc, "cpus": os.cpu_count(),
            "command": " ".join(sys.argv),
        }
        report_path.write_text(json.dumps(report, indent=1))
        lat = report.get("latency_s", {})
        print(f"sent {report.get('utterances_sent')} received {report.get('transcripts_received')} "
              f"lost {report.get('lost')} duplicates {report.get('duplicates')} p50 {lat.get('p50')} p99 {lat.get('p99')}",
              file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.stop()


if __name__ == "__main__":
    main()
