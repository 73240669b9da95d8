"""The fleet's middle alone: recorded utterances fed straight into the job streams at the rate of
N students, recognised by the workers, published to the rooms; queue -> published latency,
losses and copies, and where the CPU went (each Redis node, each worker, the injectors).

    .venv/bin/python -m benchmarks.inject --students 100000 --speak-ratio 0.1 --duration 60 \\
        --shards 3 --workers 2 --backend torch-cuda --model tiny.en --out DIR

No gateway and no simulated student: each injector process submits utterances through the
queue's own client (`RedisQueue.submit`, as a gateway does, so a job counts as queued once a
replica holds it), at the times of a Poisson process whose rate is what N students make when a
share `--speak-ratio` of them speaks at any moment: N x ratio / the clips' mean length (the load
simulator's turn-taking, streamserver/loadsim/scenario.py). Each utterance is one of the load
simulator's clips, in one of `--rooms` rooms, from one of N students. A listener subscribed to
every room's channel takes each transcript's `published_ts`; queue -> published is that minus
the moment its submit returned (one host, one clock).

It starts its own Redis Cluster (`--shards` primaries, `--replicas` each, benchmarks/local_cluster.py)
unless `--redis-url` names one, and `--workers` `streamserver worker` processes. OUT/report.json
holds every figure; OUT/logs the processes' logs and each injector's record of every utterance
(injector-N.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cpu_use import CpuSampler
from benchmarks.local_cluster import LocalCluster
from benchmarks.scaleout import EXE, _profile, _wait_http, stop_all
from streamserver.config import Settings
from tests.redis_server import free_port

IN_FLIGHT = 512  # submits one injector has outstanding at most (more: it falls behind its schedule, and says so)
SUBMIT_ATTEMPTS = 5  # tries of one utterance's submit before it counts as an error
WARMUP_S = 10.0  # the first seconds: engines' first batches of each shape; reported apart


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values)
    return {"n": len(values), **{f"p{q}": round(float(np.percentile(a, q)), 4) for q in (50, 90, 99)},
            "max": round(float(a.max()), 4), "mean": round(float(a.mean()), 4)}


# ---- one injector process ----

def _inject_process(index: int, url: str, rooms: list[str], students_per_room: int, rate: float,
                    start_at: float, duration_s: float, seed: int, out: str) -> None:
    asyncio.run(_inject(index, url, rooms, students_per_room, rate, start_at, duration_s, seed, Path(out)))


async def _inject(index: int, url: str, rooms: list[str], students_per_room: int, rate: float,
                  start_at: float, duration_s: float, seed: int, out: Path) -> None:
    from streamserver.events import Utterance
    from streamserver.loadsim.scenario import load_clips
    from streamserver.queue.base import QueueFull
    from streamserver.queue.redis_queue import RedisQueue

    clips = [(np.frombuffer(c.pcm, "<i2").astype(np.float32) / 32768.0, c.duration_s) for c in load_clips()]
    queue = RedisQueue(url)
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    slots = asyncio.Semaphore(IN_FLIGHT)
    tasks: set[asyncio.Task[None]] = set()

    async def submit(n: int, due: float) -> None:
        room = rng.choice(rooms)
        student = f"{room}-s{rng.randrange(students_per_room)}"
        audio, length = rng.choice(clips)
        began = time.time()
        u = Utterance(f"inj{index}-{n}", room, student, student, "en", audio, began - length, began)
        record: dict[str, Any] = {"id": u.utterance_id, "room": room, "due": due, "began": began, "attempts": 0}
        try:
            # As a gateway's sink does: a submit that fails (a replica behind, a connection
            # lost) is queued again; two jobs of one utterance are published once.
            while True:
                record["attempts"] += 1
                try:
                    await queue.submit(u)
                    record["queued"] = time.time()
                    break
                except QueueFull as full:
                    record["refused"] = str(full)
                    break
                except Exception as error:  # noqa: BLE001 - counted and reported, the schedule goes on
                    record["error"] = f"{type(error).__name__}: {error}"
                    if record["attempts"] >= SUBMIT_ATTEMPTS:
                        break
                    await asyncio.sleep(0.05 * record["attempts"])
        finally:
            slots.release()
        if "queued" in record:
            record.pop("error", None)
        records.append(record)

    n, due = 0, start_at
    await asyncio.sleep(max(0.0, start_at - time.time()))
    while True:
        due += rng.expovariate(rate)
        if due - start_at > duration_s:
            break
        if (wait := due - time.time()) > 0:
            await asyncio.sleep(wait)
        await slots.acquire()
        task = asyncio.create_task(submit(n, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        n += 1
    await asyncio.gather(*tasks)
    await queue.close()
    out.write_text("\n".join(json.dumps(r) for r in records) + "\n")


# ---- the listener: every room's channel ----

class Listener(threading.Thread):
    """Subscribes to every room's channel on one node (a cluster carries PUBLISH to every node)
    and keeps (utterance id, published_ts, received) of each final."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(daemon=True)
        import redis

        self.client = redis.Redis(host=host, port=port)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe("*room:inj-*")
        self.finals: list[tuple[str, float, float]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            message = self.pubsub.get_message(timeout=0.2)
            if message is None or message["type"] != "pmessage":
                continue
            received = time.time()
            event = json.loads(message["data"])
            if event.get("type") in ("transcript", "no_speech"):
                self.finals.append((event["utterance_id"], float(event["published_ts"]), received))

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)
        self.pubsub.close()
        self.client.close()


def _depth_sampler(url: str, stop: threading.Event, samples: list[tuple[float, int]]) -> None:
    """Every second: the jobs waiting or in a worker's hands, over every stream."""
    from redis.cluster import ClusterNode, RedisCluster

    from streamserver.bus.keys import CLUSTER_SHARDS, KeyLayout

    hosts = url.split("://", 1)[1].split(",")
    client = RedisCluster(startup_nodes=[ClusterNode(h.split(":")[0], int(h.split(":")[1])) for h in hosts])
    keys = KeyLayout(CLUSTER_SHARDS)
    t0 = time.time()
    while not stop.wait(1.0):
        try:
            samples.append((round(time.time() - t0, 1), sum(client.xlen(keys.jobs(k)) for k in range(CLUSTER_SHARDS))))
        except Exception:  # noqa: BLE001 - a sample missed is a gap in the curve
            pass
    client.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--students", type=int, default=100_000, help="the students whose speech is injected")
    p.add_argument("--speak-ratio", type=float, default=0.1, help="share of them speaking at any moment")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of injection")
    p.add_argument("--drain", type=float, default=20.0, help="seconds to wait for the last results")
    p.add_argument("--rooms", type=int, help="rooms the students sit in (default: one per 125 students)")
    p.add_argument("--shards", type=int, default=3, help="primaries of the cluster started here")
    p.add_argument("--replicas", type=int, default=1, help="replicas of each primary")
    p.add_argument("--redis-url", help="a running redis+cluster:// deployment instead of starting one")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=4, help="per worker (its intent labels on a CPU)")
    p.add_argument("--model", default=Settings.model)
    p.add_argument("--backend", default=Settings.backend)
    p.add_argument("--worker-args", default="", metavar="ARGS", help="more arguments for every worker, one shell-quoted string")
    p.add_argument("--stub-engine", type=float, metavar="S",
                   help="workers with a stand-in engine that sleeps S a batch (benchmarks/stub_worker.py): the "
                        "worker's own CPU alone, on any machine")
    p.add_argument("--injectors", type=int, default=4, help="injector processes")
    p.add_argument("--ready-timeout", type=float, default=300, metavar="S", help="longest wait for a worker's /readyz")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.students < 1 or not 0 < args.speak_ratio <= 1 or args.injectors < 1 or args.workers < 0:
        p.error("need --students >= 1, 0 < --speak-ratio <= 1, --injectors >= 1, --workers >= 0")

    from streamserver.loadsim.scenario import load_clips

    mean_clip_s = float(np.mean([c.duration_s for c in load_clips()]))
    rate = args.students * args.speak_ratio / mean_clip_s
    rooms = [f"inj-{i}" for i in range(args.rooms or max(1, args.students // 125))]
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print(f"{args.students} students, {args.speak_ratio:.0%} speaking, clips of {mean_clip_s:.2f} s on average: "
          f"{rate:.1f} utterances/s into {len(rooms)} rooms for {args.duration:.0f} s", file=sys.stderr, flush=True)

    cluster = None if args.redis_url else LocalCluster(args.shards, args.replicas, logs / "cluster").start()
    url = args.redis_url or cluster.url  # type: ignore[union-attr]
    first = url.split("://", 1)[1].split(",")[0].rsplit("@", 1)[-1]
    procs: list[subprocess.Popen] = []
    injectors: list[multiprocessing.Process] = []
    try:
        workers = []
        for i in range(args.workers):
            mport = free_port()
            if args.stub_engine is not None:
                command = [sys.executable, "-m", "benchmarks.stub_worker", "--engine-s", str(args.stub_engine)]
            else:
                command = EXE + ["worker", "--model", args.model, "--backend", args.backend, "--threads", str(args.threads)]
            w = subprocess.Popen(
                command + ["--redis-url", url, "--name", f"worker-{i}", "--metrics-port", str(mport), *shlex.split(args.worker_args)],
                env=env, stdout=open(logs / f"worker-{i}.log", "w"), stderr=subprocess.STDOUT)
            procs.append(w)
            workers.append((w, mport))
        t_ready = time.monotonic()
        for w, mport in workers:
            _wait_http(f"http://127.0.0.1:{mport}/readyz", args.ready_timeout, "worker", w)
        ready_s = round(time.monotonic() - t_ready, 1)
        print(f"{args.workers} workers ready after {ready_s} s", file=sys.stderr, flush=True)

        listener = Listener(first.split(":")[0], int(first.split(":")[1]))
        listener.start()
        depth: list[tuple[float, int]] = []
        depth_stop = threading.Event()
        threading.Thread(target=_depth_sampler, args=(url, depth_stop, depth), daemon=True).start()
        start_at = time.time() + 3.0  # every injector imports and connects first
        ctx = multiprocessing.get_context("spawn")
        for i in range(args.injectors):
            proc = ctx.Process(target=_inject_process, args=(i, url, rooms[i::args.injectors] or rooms, max(1, args.students // len(rooms)),
                                                             rate / args.injectors, start_at, args.duration, args.seed * 1000 + i,
                                                             str(logs / f"injector-{i}.jsonl")))
            proc.start()
            injectors.append(proc)
        pids = {f"worker-{i}": w.pid for i, (w, _) in enumerate(workers)}
        pids.update({f"injector-{i}": proc.pid for i, proc in enumerate(injectors) if proc.pid is not None})
        if cluster is not None:
            pids.update(cluster.pids())
        cpu = CpuSampler(pids)
        time.sleep(max(0.0, start_at - time.time()))
        cpu.start()
        # SCALEOUT_PYSPY=<py-spy>: worker-0's stacks over the middle third (logs/worker-0.pyspy.txt)
        profilers = _profile([("worker-0", workers[0][0].pid)], logs, args.duration) if workers else []
        node_cpu_0 = cluster.cpu_seconds() if cluster is not None else {}
        t0 = time.time()
        for proc in injectors:
            proc.join(args.duration + 120)
        injecting_s = time.time() - t0
        node_cpu_1 = cluster.cpu_seconds() if cluster is not None else {}
        cpu.stop()
        for profiler in profilers:
            profiler.wait(30)
        # the last results: until every queued utterance is published, or --drain seconds
        queued_ids = set()
        records: list[dict[str, Any]] = []
        for i in range(args.injectors):
            path = logs / f"injector-{i}.jsonl"
            if path.exists():
                records += [json.loads(line) for line in path.read_text().splitlines() if line]
        queued_ids = {r["id"] for r in records if "queued" in r}
        deadline = time.time() + args.drain
        while time.time() < deadline and not queued_ids <= {uid for uid, _, _ in listener.finals}:
            time.sleep(0.5)
        depth_stop.set()
        listener.stop()
        report = _report(args, rate, mean_clip_s, len(rooms), records, listener.finals, injecting_s, t0, ready_s,
                         node_cpu_0, node_cpu_1, cpu.summary(), depth, url)
        (args.out / "report.json").write_text(json.dumps(report, indent=1))
        s = report["steady"]["queue_to_published_s"] or {}
        print(f"offered {report['offered_per_s']} utt/s, submitted {report['submitted']}, queued {report['queued']}, "
              f"refused {report['refused']}, errors {report['errors']}, published {report['published']}, lost {report['lost']}, "
              f"copies {report['copies']}; queue -> published p50 {s.get('p50')} p99 {s.get('p99')} s (after {WARMUP_S:.0f} s); "
              f"Redis cores {report['redis_cores']}; worker CPU {report['worker_cpu_ms_per_utterance']} ms an utterance", file=sys.stderr, flush=True)
        return 0
    finally:
        for proc in injectors:
            if proc.is_alive():
                proc.terminate()
        stop_all(procs)
        if cluster is not None:
            cluster.stop()


def _report(args: argparse.Namespace, rate: float, mean_clip_s: float, rooms: int, records: list[dict[str, Any]],
            finals: list[tuple[str, float, float]], injecting_s: float, t0: float, ready_s: float,
            node_cpu_0: dict[str, float], node_cpu_1: dict[str, float], cpu: dict[str, Any],
            depth: list[tuple[float, int]], url: str) -> dict[str, Any]:
    queued = {r["id"]: r for r in records if "queued" in r}
    published: dict[str, tuple[float, float]] = {}
    copies = 0
    for uid, published_ts, received in finals:
        if uid in published:
            copies += 1
        else:
            published[uid] = (published_ts, received)

    def part(after: float) -> dict[str, Any]:
        chosen = [r for r in queued.values() if r["began"] - t0 >= after and r["id"] in published]
        return {
            "queue_to_published_s": _quantiles([published[r["id"]][0] - r["queued"] for r in chosen]),
            "published_to_listener_s": _quantiles([published[r["id"]][1] - published[r["id"]][0] for r in chosen]),
            "submit_s": _quantiles([r["queued"] - r["began"] for r in queued.values() if r["began"] - t0 >= after]),
            "injector_late_s": _quantiles([r["began"] - r["due"] for r in records if r["began"] - t0 >= after]),
        }

    window = max(injecting_s, 1e-3)
    # the workers' CPU per result they published while the CPU was sampled (the injection)
    published_in_window = sum(t0 <= ts <= t0 + injecting_s for ts, _ in published.values())
    worker_cpu_s = cpu.get("cpu_s_by_kind", {}).get("worker")
    return {
        "students": args.students, "speak_ratio": args.speak_ratio, "duration_s": args.duration, "rooms": rooms,
        "mean_clip_s": round(mean_clip_s, 3), "offered_per_s": round(rate, 1),
        "submitted": len(records), "queued": len(queued),
        "refused": sum("refused" in r for r in records), "errors": sum("error" in r for r in records),
        "submits_again": sum(r.get("attempts", 1) - 1 for r in records),
        "error_kinds": sorted({r["error"].split(":")[0] for r in records if "error" in r}),
        "published": len(set(published) & set(queued)), "lost": len(set(queued) - set(published)),
        "copies": copies, "published_per_s": round(len(published) / window, 1),
        "all": part(0.0), "steady": part(WARMUP_S),
        "redis_cores": {name: round((node_cpu_1.get(name, 0.0) - used) / window, 3) for name, used in node_cpu_0.items()},
        "cpu": cpu, "published_while_sampled": published_in_window,
        "worker_cpu_ms_per_utterance": round(1000 * worker_cpu_s / published_in_window, 3)
        if worker_cpu_s is not None and published_in_window else None,
        "jobs_waiting_max": max((d for _, d in depth), default=None), "jobs_waiting": depth,
        "scenario": {"url": url, "shards": args.shards, "replicas": args.replicas, "workers": args.workers,
                     "threads_per_worker": args.threads, "model": args.model, "backend": args.backend,
                     "worker_args": args.worker_args, "stub_engine_s": args.stub_engine, "injectors": args.injectors, "ready_after_s": ready_s,
                     "warmup_s": WARMUP_S, "cpus": os.cpu_count(), "command": " ".join(sys.argv)},
    }


if __name__ == "__main__":
    sys.exit(main())
