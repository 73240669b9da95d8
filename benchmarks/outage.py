"""An on-prem gateway's class through an uplink outage, counted by the load simulator (issue 14).

    .venv/bin/python -m benchmarks.outage --students 20 --duration 100 --cut-at 30 --cut-for 30 \\
        --out benchmarks/results/outage-2core

Starts a redis-server (the central one, append-only), a TCP proxy in front of it
(tests/tcp_proxy.py: a cut swallows every byte, no reset, like a dead internet link), one
`streamserver worker` on the Redis itself and one `streamserver gateway --spool-dir DIR
--fallback-model tiny.en` through the proxy, then `streamserver loadsim` (WebSocket students)
against the gateway; the proxy is cut --cut-at seconds into the class for --cut-for seconds.
OUT/report.json: the simulator's report (lost and duplicated against the clips the students
said, latency end of speech -> dashboard), and from the central history afterwards: each
utterance's result once (`central_history`), and for the fallback's results the gateway's delay
from end of speech to publishing them on its dashboards (`fallback_s`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

from benchmarks.scaleout import EXE, _log_tails, _wait_http, stop_all
from streamserver.bus.keys import history_key
from streamserver.loadsim.measure import latency_summary
from tests.redis_server import RedisServer, free_port
from tests.tcp_proxy import TcpProxy


def central_history(url: str) -> list[dict]:
    """Every room's results in the central history."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        events = []
        for key in client.scan_iter(match=history_key("*")):
            events += [json.loads(f["event"]) for _id, f in client.xrange(key)]
    finally:
        client.close()
    return [e for e in events if e.get("type") in ("transcript", "no_speech")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--students", type=int, default=20)
    p.add_argument("--duration", type=float, default=100)
    p.add_argument("--speak-ratio", type=float, default=0.1)
    p.add_argument("--cut-at", type=float, default=30, help="seconds into the class")
    p.add_argument("--cut-for", type=float, default=30)
    p.add_argument("--fallback-model", default="tiny.en")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="outage-logs-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STREAMSERVER_SECRET": secrets.token_hex(32),
           "STREAMSERVER_ADMIN_TOKEN": os.environ.get("STREAMSERVER_ADMIN_TOKEN") or "outage-admin"}
    central = RedisServer(persist_dir=logs / "aof").start()
    proxy = TcpProxy("127.0.0.1", central.port).start()
    port, mport = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []

    def start(name: str, *command: str) -> subprocess.Popen:
        proc = subprocess.Popen(EXE + list(command), env=env, stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    try:
        worker = start("worker", "worker", "--redis-url", central.url, "--threads", "1", "--metrics-port", str(mport))
        gateway = start("gateway", "gateway", "--port", str(port), "--redis-url", proxy.url(), "--spool-dir", str(logs / "spool"),
                        "--fallback-model", args.fallback_model)
        _wait_http(f"http://127.0.0.1:{mport}/readyz", 180, "worker", worker)
        _wait_http(url + "/readyz", 120, "gateway", gateway)
        timeline: list[tuple[float, str]] = []

        def outage(started: float) -> None:
            time.sleep(max(0.0, started + args.cut_at - time.time()))
            proxy.cut()
            timeline.append((time.time(), "cut"))
            print(f"outage: uplink cut at {args.cut_at:.0f} s", file=sys.stderr, flush=True)
            time.sleep(args.cut_for)
            proxy.restore()
            timeline.append((time.time(), "restored"))
            print(f"outage: uplink back at {args.cut_at + args.cut_for:.0f} s", file=sys.stderr, flush=True)

        started = time.time()
        threading.Thread(target=outage, args=(started,), daemon=True).start()
        sim = subprocess.run(EXE + ["loadsim", "--url", url, "--students", str(args.students), "--duration", str(args.duration),
                                    "--speak-ratio", str(args.speak_ratio), "--transport", "ws", "--drain", "30",
                                    "--report", str(args.out)], env=env)
        time.sleep(5)  # the last fallback results reach the central history
        report = json.loads((args.out / "report.json").read_text())
        history = central_history(central.url)
        ids = [e["utterance_id"] for e in history]
        fallback = [e for e in history if e.get("fallback")]
        report["outage"] = {
            "cut_at_s": args.cut_at, "cut_for_s": args.cut_for,
            "events": [{"t_s": round(t - started, 2), "what": what} for t, what in timeline],
            "central_history": {"results": len(ids), "distinct": len(set(ids)), "fallback": len(fallback)},
            "fallback_s": latency_summary([e["published_ts"] - e["end_of_speech_ts"] for e in fallback]),
            "gateway": f"gateway --spool-dir --fallback-model {args.fallback_model}, Redis through a TCP proxy cut for "
                       f"{args.cut_for:.0f} s (bytes swallowed, no reset)",
            "loadsim_exit": sim.returncode, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
        }
        (args.out / "report.json").write_text(json.dumps(report, indent=1))
        summary = {k: report.get(k) for k in ("utterances_sent", "transcripts_received", "lost", "duplicates", "latency_s")}
        print(json.dumps({**summary, "outage": report["outage"]}, indent=1))
        ok = report.get("lost") == 0 and report.get("duplicates") == 0 and len(ids) == len(set(ids)) == report.get("utterances_sent")
        return 0 if ok and sim.returncode == 0 else 1
    except Exception:
        _log_tails(logs)
        raise
    finally:
        stop_all(procs)
        proxy.stop()
        central.stop()
        print(f"logs in {logs}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
