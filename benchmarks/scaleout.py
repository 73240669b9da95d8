"""A class on gateway + workers + Redis, simulated students over WebSocket, optionally one worker
killed with SIGKILL halfway: lost and duplicated utterances and end-of-speech -> dashboard latency.

    STREAMSERVER_ADMIN_TOKEN=... .venv/bin/python -m benchmarks.scaleout --students 100 --duration 60 \\
        --workers 2 --kill-at 30 --out benchmarks/results/scaleout-2core-kill

Starts its own redis-server (append-only), G `streamserver gateway` processes (--gateways, on
ports of their own, sharing one STREAMSERVER_SECRET) and N `streamserver worker` processes, waits
until every worker answers /readyz (a GPU worker compiles for a minute or two first) and every
gateway sees one, runs `streamserver loadsim` against all the gateways (--loadsim-processes P
student processes), and writes OUT/report.json (the simulator's report plus the scenario and what
was killed and when) with the simulator's plots beside it; the processes' logs go to --logs
(default OUT/logs). benchmarks/scaleout_device.sh runs it on the GPU machine:

    .venv/bin/python -m benchmarks.scaleout --students 2000 --duration 60 --rooms 20 --gateways 8 \\
        --loadsim-processes 6 --workers 1 --worker-args "--backend torch-cuda --max-batch 64" --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.cpu_use import CpuSampler
from streamserver.audio.segmenter import SegmenterConfig
from streamserver.config import Settings
from streamserver.loadsim.config import LoadConfig
from tests.redis_server import RedisServer, free_port

EXE = [sys.executable, "-m", "streamserver"]


def _wait_http(url: str, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    """Until `url` answers 200; fails at once when `proc` (the process that should answer) exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before {url} answered (see its log)")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} not ready at {url} after {timeout_s:.0f}s")


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each process still running, then up to 10 s each before SIGKILL."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


HINT_FAMILIES = ("streamserver_hints_total", "streamserver_partials_total", "streamserver_speculations_total",
                 "streamserver_utterances_total", "streamserver_recognition_seconds_total", "streamserver_batch_size_sum",
                 "streamserver_batch_size_count", "streamserver_event_loop_lag_seconds_bucket", "streamserver_worker_seconds_total")
# Sampled from each worker once a second (report's worker_timeline): where its loop spent that second.
WORKER_FAMILIES = ("streamserver_worker_seconds_total", "streamserver_recognition_seconds_total", "streamserver_partials_total",
                   "streamserver_speculations_total", "streamserver_utterances_total", "streamserver_batch_size_count",
                   "streamserver_batch_size_sum", "streamserver_engine_busy_ratio", "streamserver_queue_depth")


def _read_metrics(url: str, families: tuple[str, ...], token: str | None = None) -> dict[str, float]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=5) as r:
        text = r.read().decode()
    return {name: float(value) for line in text.splitlines() if line.startswith(families)
            for name, value in [line.rsplit(" ", 1)]}


class WorkerTimeline(threading.Thread):
    """Each worker's counters once a second, kept as what each grew by in that second (gauges as
    read): which step of a worker's loop took a second in which the queue grew."""

    def __init__(self, urls: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.urls, self.rows, self._done = urls, [], threading.Event()

    def run(self) -> None:
        started, last = time.monotonic(), {}
        while not self._done.wait(1.0):
            row = {"t": round(time.monotonic() - started, 1)}
            for name, url in self.urls.items():
                try:
                    now = _read_metrics(url, WORKER_FAMILIES)
                except OSError:
                    continue
                before = last.get(name, {})
                row[name] = {k: round(v if k.startswith(("streamserver_engine_busy", "streamserver_queue_depth"))
                                      else v - before.get(k, 0.0), 4) for k, v in now.items()}
                last[name] = now
            self.rows.append(row)

    def stop(self) -> list[dict]:
        self._done.set()
        self.join(5)
        return self.rows


def _hint_counters(worker_urls: list[str], gateway_urls: list[str], token: str) -> dict[str, float]:
    """The live workers' and the gateways' caption and speculation counters, summed by sample
    (a gateway's /metrics needs the admin token)."""
    totals: dict[str, float] = {}
    for url, auth in [*((u, None) for u in worker_urls), *((u, token) for u in gateway_urls)]:
        try:
            counters = _read_metrics(url, HINT_FAMILIES, auth)
        except OSError as error:
            print(f"no metrics from {url}: {error}", file=sys.stderr, flush=True)
            continue
        for name, value in counters.items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


def _profile(targets: list[tuple[str, int]], logs: Path, duration_s: float) -> list[subprocess.Popen]:
    """With SCALEOUT_PYSPY=<py-spy binary>: where gateway-0 and worker-0 spend their time, sampled
    by py-spy for the middle third of the run (LOGS/<name>.pyspy.txt, py-spy's raw format: one line
    per stack with its sample count, per thread). SCALEOUT_PYSPY_FROM=0 samples the first third
    instead (where a fresh GPU machine's first run has its slow batches)."""
    pyspy = os.environ.get("SCALEOUT_PYSPY")
    if not pyspy:
        return []
    third = max(1, int(duration_s / 3))
    start = int(os.environ.get("SCALEOUT_PYSPY_FROM", third))
    return [subprocess.Popen(["sh", "-c", f"sleep {start} && exec {shlex.quote(pyspy)} record --nonblocking --threads -r 50 "
                              f"-d {third} -f raw -p {pid} -o {shlex.quote(str(logs / (name + '.pyspy.txt')))}"],
                             stdout=subprocess.DEVNULL, stderr=open(logs / f"{name}.pyspy.log", "w"))
            for name, pid in targets]


REDIS_LATENCY_MS = 20  # Redis's own latency monitor notes every event (fork, AOF write, command) this slow


def _redis_call(url: str, *command: str):  # noqa: ANN202 - a Redis reply
    import redis

    client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=10)
    try:
        return client.execute_command(*command)
    finally:
        client.close()


def _redis_stalls(url: str) -> dict:
    """What stopped Redis for REDIS_LATENCY_MS or more during the run (LATENCY LATEST: event ->
    how often the latest and the worst took), and its append-only file's rewrites and late fsyncs."""
    try:
        latest = _redis_call(url, "LATENCY", "LATEST")
        info = _redis_call(url, "INFO", "persistence") | _redis_call(url, "INFO", "stats")
    except Exception as error:  # noqa: BLE001 - a diagnosis: its absence must not fail the run
        return {"error": str(error)}
    keys = ("aof_enabled", "aof_current_size", "aof_base_size", "aof_delayed_fsync", "aof_last_rewrite_time_sec",
            "total_forks", "latest_fork_usec")
    return {"latency_latest": {e[0]: {"latest_ms": e[2], "max_ms": e[3]} for e in latest},
            **{k: info.get(k) for k in keys}}


def _log_tails(logs: Path, lines: int = 15) -> None:
    """The end of every process log on stderr: what a failed run needs first."""
    for log in sorted(logs.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {log.name} (last {len(tail)} lines)", *tail, sep="\n", file=sys.stderr, flush=True)


def _stall(proc: subprocess.Popen, started: float, at_s: float, for_s: float, share: float) -> None:
    """Stop and continue `proc` so that it runs (1 - share) of each second, from at_s for for_s."""
    time.sleep(max(0.0, started + at_s - time.time()))
    end = time.time() + for_s
    while time.time() < end and proc.poll() is None:
        proc.send_signal(signal.SIGSTOP)
        time.sleep(min(share, end - time.time()))
        proc.send_signal(signal.SIGCONT)
        time.sleep(max(0.0, min(1.0 - share, end - time.time())))


def main() -> int:
    """0 when the simulator ran and wrote its report; 1 otherwise (the logs' tails on stderr)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--students", type=int, default=100)
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--rooms", type=int, default=LoadConfig.rooms)
    p.add_argument("--speak-ratio", type=float, default=LoadConfig.speak_ratio)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="per worker")
    p.add_argument("--max-batch", type=int, help="per worker (default: the worker's, by its engine)")
    p.add_argument("--model", default=Settings.model)
    p.add_argument("--backend", default=Settings.backend)
    p.add_argument("--worker-args", default="", metavar="ARGS",
                   help="more arguments for every worker, one shell-quoted string (e.g. \"--backend torch-cuda --max-batch 64\"; "
                   "a flag given here overrides the one built from --model/--backend/--threads/--max-batch)")
    p.add_argument("--gateways", type=int, default=1, metavar="G", help="gateway commands; the simulator's rooms are spread over them")
    p.add_argument("--gateway-processes", default="1", metavar="N|auto",
                   help="each gateway command's --processes: N gateways on its one port (auto: one per core)")
    p.add_argument("--vad-hangover-ms", type=int, metavar="MS", help=f"the gateways' --vad-hangover-ms (default: theirs, {SegmenterConfig.hangover_ms})")
    p.add_argument("--loadsim-processes", type=int, default=LoadConfig.processes, metavar="P", help="the simulator's --processes")
    p.add_argument("--transport", choices=("ws", "webrtc"), default=LoadConfig.transport, help="how the simulated students send audio")
    p.add_argument("--ready-timeout", type=float, default=180, metavar="S",
                   help="longest wait for a worker's /readyz (the GPU engine compiles for 1-2 minutes first)")
    p.add_argument("--logs", type=Path, metavar="DIR", help="the processes' logs (default OUT/logs)")
    p.add_argument("--kill-at", type=float, help="SIGKILL worker 0 this many seconds into the run")
    p.add_argument("--restart-after", type=float, help="start a replacement worker this long after the kill "
                   "(what a supervisor such as docker's restart policy does)")
    p.add_argument("--kill-gateway-at", type=float, metavar="S",
                   help="SIGKILL gateway 0 this many seconds into the run (needs --gateways >= 2): its students, who keep "
                   "their audio, reconnect through the next gateway and send again what was not acknowledged")
    p.add_argument("--stall", nargs=4, action="append", default=[], metavar=("WHO", "AT", "FOR", "SHARE"),
                   help="from AT s into the run, for FOR s, keep WHO (gateway: gateway 0; loadsim: the simulator) "
                   "stopped (SIGSTOP) SHARE of every second: an event loop far behind, as on a host past its "
                   "capacity (repeatable)")
    p.add_argument("--no-keep-audio", action="store_true",
                   help="the simulated students keep nothing (loadsim --no-keep-audio): what a break costs without it")
    p.add_argument("--redis-args", default="", help="more redis-server options, as one string (a diagnosis)")
    p.add_argument("--no-aof", action="store_true",
                   help="Redis without its append-only file (a diagnosis: what the AOF costs; deployments keep it)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if any(who not in ("gateway", "loadsim") for who, *_ in args.stall):
        p.error("--stall stops the gateway or the loadsim")
    if args.kill_gateway_at is not None and args.gateways < 2:
        p.error("--kill-gateway-at needs --gateways >= 2 (its students reconnect through another)")

    if args.gateways < 1 or not 1 <= args.loadsim_processes <= args.students:
        p.error("need --gateways >= 1 and 1 <= --loadsim-processes <= --students")
    token = os.environ.setdefault("STREAMSERVER_ADMIN_TOKEN", "scaleout-admin")
    # One secret for every gateway: a room's token, signed by the gateway that created the room,
    # is checked by whichever gateway its student or teacher comes in through.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STREAMSERVER_SECRET": os.environ.get("STREAMSERVER_SECRET") or secrets.token_hex(32)}
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.logs or args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    redis = RedisServer(persist_dir=None if args.no_aof else Path(tempfile.mkdtemp(prefix="scaleout-redis-")),
                        extra_args=tuple(shlex.split(args.redis_args))).start()
    _redis_call(redis.url, "CONFIG", "SET", "latency-monitor-threshold", str(REDIS_LATENCY_MS))
    procs: list[subprocess.Popen] = []
    started_at = time.monotonic()
    failed = True
    try:
        hangover = ["--vad-hangover-ms", str(args.vad_hangover_ms)] if args.vad_hangover_ms is not None else []
        gateways: list[tuple[subprocess.Popen, str]] = []
        for i in range(args.gateways):
            port = free_port()
            name = "gateway" if args.gateways == 1 else f"gateway-{i}"
            g = subprocess.Popen(
                EXE + ["gateway", "--port", str(port), "--redis-url", redis.url, "--ice-host", "127.0.0.1",
                       "--processes", args.gateway_processes, *hangover],
                env=env, stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT,
            )
            procs.append(g)
            gateways.append((g, f"http://127.0.0.1:{port}"))

        def start_worker(name: str) -> tuple[subprocess.Popen, int]:
            mport = free_port()
            w = subprocess.Popen(
                EXE + ["worker", "--redis-url", redis.url, "--model", args.model, "--backend", args.backend,
                       "--threads", str(args.threads), *(["--max-batch", str(args.max_batch)] if args.max_batch else []), "--name", name,
                       "--metrics-port", str(mport), *shlex.split(args.worker_args)],
                env=env, stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT,
            )
            procs.append(w)
            return w, mport

        workers = [start_worker(f"worker-{i}") for i in range(args.workers)]
        urls = [url for _, url in gateways]
        for g, url in gateways:
            _wait_http(url + "/healthz", 60, "gateway", g)
        print(f"{len(urls)} gateways up; waiting for {args.workers} workers' /readyz (up to {args.ready_timeout:.0f}s)",
              file=sys.stderr, flush=True)
        for w, mport in workers:
            _wait_http(f"http://127.0.0.1:{mport}/readyz", args.ready_timeout, "worker", w)
        for g, url in gateways:  # each one sees a live worker (else it would answer every student "busy")
            _wait_http(url + "/readyz", 30, "gateway", g)
        ready_s = round(time.monotonic() - started_at, 1)
        print(f"gateways {' '.join(urls)} and {args.workers} workers ready after {ready_s}s; simulating {args.students} students",
              file=sys.stderr, flush=True)
        sim = subprocess.Popen(
            EXE + ["loadsim", *[a for url in urls for a in ("--url", url)], "--students", str(args.students),
                   "--duration", str(args.duration), "--rooms", str(args.rooms), "--speak-ratio", str(args.speak_ratio),
                   "--transport", args.transport, "--processes", str(args.loadsim_processes), "--report", str(args.out),
                   *(["--no-keep-audio"] if args.no_keep_audio else [])],
            env={**env, "STREAMSERVER_ADMIN_TOKEN": token},
        )
        # Which process used the host's cores: the students are simulated on the same host.
        cpu = CpuSampler({**{f"gateway-{i}": g.pid for i, (g, _) in enumerate(gateways)},
                          **{f"worker-{i}": w.pid for i, (w, _) in enumerate(workers)},
                          "redis": redis.pid, "loadsim": sim.pid})
        cpu.start()
        worker_timeline = WorkerTimeline({f"worker-{i}": f"http://127.0.0.1:{mport}/metrics" for i, (_, mport) in enumerate(workers)})
        worker_timeline.start()
        profiles = _profile([("gateway-0", gateways[0][0].pid), ("worker-0", workers[0][0].pid)], logs, args.duration)
        killed = gateway_killed = None
        started = time.time()
        for who, *times in args.stall:
            victim = {"gateway": gateways[0][0], "loadsim": sim}[who]
            threading.Thread(target=_stall, args=(victim, started, *map(float, times)), daemon=True).start()
        if args.kill_gateway_at is not None:
            while sim.poll() is None and time.time() - started < args.kill_gateway_at:
                time.sleep(0.2)
            gateways[0][0].send_signal(signal.SIGKILL)
            gateway_killed = {"gateway": "gateway-0", "at_s": round(time.time() - started, 1), "signal": "SIGKILL"}
            print(f"killed gateway-0 at {gateway_killed['at_s']}s", file=sys.stderr, flush=True)
            gateways = gateways[1:]  # its metrics are gone with it
        if args.kill_at is not None:
            while sim.poll() is None and time.time() - started < args.kill_at:
                time.sleep(0.2)
            victim = workers[0][0]
            victim.send_signal(signal.SIGKILL)
            killed = {"worker": "worker-0", "at_s": round(time.time() - started, 1), "signal": "SIGKILL"}
            print(f"killed worker-0 at {killed['at_s']}s", file=sys.stderr, flush=True)
            if args.restart_after is not None:
                time.sleep(args.restart_after)
                cpu.add("worker-0-restarted", start_worker("worker-0-restarted")[0].pid)
                killed["replacement_started_at_s"] = round(time.time() - started, 1)
        rc = sim.wait()
        cpu.stop()
        worker_rows = worker_timeline.stop()
        for proc in profiles:
            proc.wait()
        counters = _hint_counters([f"http://127.0.0.1:{mport}/metrics" for w, mport in workers if w.poll() is None],
                                  [url + "/metrics" for _, url in gateways], token)
        report_path = args.out / "report.json"
        simulated = report_path.exists()
        report = json.loads(report_path.read_text()) if simulated else {}
        report["scenario"] = {
            "gateways": args.gateways, "workers": args.workers, "threads_per_worker": args.threads, "max_batch": args.max_batch, "model": args.model,
            "backend": args.backend, "worker_args": args.worker_args, "vad_hangover_ms": args.vad_hangover_ms or SegmenterConfig.hangover_ms,
            "loadsim_processes": args.loadsim_processes, "ready_after_s": ready_s,
            "ort_spin": env.get("STREAMSERVER_ORT_SPIN", "0 (the worker default)"), "killed": killed, "gateway_killed": gateway_killed, "students_keep_audio": not args.no_keep_audio, "redis_aof": not args.no_aof, "redis_args": args.redis_args, "loadsim_exit": rc, "cpus": os.cpu_count(),
            "command": " ".join(sys.argv),
        }
        report["cpu"] = cpu.summary()
        report["hint_counters"] = counters  # live captions and speculative finals, as the processes count them
        report["redis"] = _redis_stalls(redis.url)
        report["worker_timeline"] = worker_rows
        report_path.write_text(json.dumps(report, indent=1))
        lat = report.get("latency_s", {})
        print(f"sent {report.get('utterances_sent')} received {report.get('transcripts_received')} "
              f"lost {report.get('lost')} duplicates {report.get('duplicates')} join failures {report.get('join_failures')} "
              f"busy {report.get('busy_rejections')} p50 {lat.get('p50')} p99 {lat.get('p99')}",
              file=sys.stderr, flush=True)
        failed = rc != 0 or not simulated
    finally:
        if failed:
            _log_tails(logs)
        stop_all(procs)
        redis.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
