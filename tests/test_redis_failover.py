"""Issue 31: a class on a replicated Redis whose primary is SIGKILLed mid-class.

A real Redis Cluster (3 primaries, 3 replicas) and a real Sentinel set (one primary, one replica,
three sentinels), each started by the test from Debian's redis-server; a gateway and two tiny.en
workers (onnxruntime) on it; 100 simulated students (the load simulator, which keeps each
student's audio and sends again what was not acknowledged, as the student page does). A primary
dies mid-class and its replica is promoted; counted against what the students said: 0 lost, 0
duplicated (a copy under another utterance id counts too), the rooms spread over every shard of
the cluster, and the teacher feeds go on after the failover.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import redis

from benchmarks.scaleout import stop_all
from streamserver.bus.keys import CLUSTER_SHARDS, KeyLayout
from tests.redis_cluster import RedisClusterServers, RedisSentinelServers, cluster_tools_missing
from tests.server_process import ADMIN_TOKEN, free_port
from tests.system_packages import needs_system
from tests.test_gateway import _wait

pytestmark = needs_system("redis-server (Debian's, with redis-cli)", cluster_tools_missing())

STUDENTS = 100
ROOMS = 20  # 5 students a room; 20 rooms over 12 shards reach every primary of 3 (but for ~1 run in 1,000)
DURATION_S = 36
KILL_AT_S = 12  # into the simulated class
ENV = dict(os.environ, STREAMSERVER_ADMIN_TOKEN=ADMIN_TOKEN, STREAMSERVER_SECRET="redis-failover-secret",
           PYTHONUNBUFFERED="1")


def _start(log: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "streamserver", *args], env=ENV, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2500:] if path.exists() else ""


def run_class(tmp_path: Path, url: str, kill: Callable[[], object]) -> tuple[dict, float, object]:
    """A gateway and two workers on `url`, the simulated class against the gateway, `kill` called
    KILL_AT_S into it; the simulator's report, when (seconds into the class) the kill returned,
    and what it returned."""
    port = free_port()
    gateway_url = f"http://127.0.0.1:{port}"
    procs = [_start(tmp_path / "gateway.log", "gateway", "--port", str(port), "--redis-url", url, "--ice-host", "127.0.0.1",
                   # Two tiny.en workers of one thread on a shared 2-core host measure ~2 utterances/s:
                   # admission must seat the whole class, which speaks 6 % of the time.
                   "--expected-speaking", "0.02")]
    metrics = [free_port() for _ in range(2)]
    procs += [_start(tmp_path / f"worker-{i}.log", "worker", "--redis-url", url, "--model", "tiny.en", "--threads", "1",
                     "--name", f"worker-{i}", "--metrics-port", str(mport)) for i, mport in enumerate(metrics)]
    outcome: dict[str, object] = {}
    try:
        _wait(gateway_url + "/healthz", 60)
        for mport in metrics:
            _wait(f"http://127.0.0.1:{mport}/readyz", 180)
        _wait(gateway_url + "/readyz", 30)
        out = tmp_path / "report"
        started = time.monotonic()
        sim = subprocess.Popen(
            [sys.executable, "-m", "streamserver", "loadsim", "--url", gateway_url, "--students", str(STUDENTS),
             "--rooms", str(ROOMS), "--duration", str(DURATION_S), "--speak-ratio", "0.06", "--drain", "40",
             "--report", str(out)],
            env=ENV, stdout=(tmp_path / "loadsim.log").open("w"), stderr=subprocess.STDOUT)

        def killer() -> None:
            time.sleep(KILL_AT_S)
            outcome["result"] = kill()
            outcome["at"] = time.monotonic() - started

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        sim.wait(timeout=DURATION_S + 100)
        thread.join(30)
        assert sim.returncode == 0, _tail(tmp_path / "loadsim.log") + _tail(tmp_path / "gateway.log")
        for i, proc in enumerate(procs):
            assert proc.poll() is None, f"process {i} died: " + _tail(tmp_path / ("gateway.log" if i == 0 else f"worker-{i - 1}.log"))
        return json.loads((out / "report.json").read_text()), float(outcome["at"]), outcome.get("result")
    finally:
        stop_all(procs)


def check_exactly_once(report: dict, killed_at: float) -> None:
    print({k: report[k] for k in ("utterances_sent", "transcripts_received", "lost", "duplicates", "copies", "recovered",
                                  "reconnects", "join_failures", "busy_rejections", "latency_s")})
    assert report["join_failures"] == 0 and report["busy_rejections"] == 0
    assert report["utterances_sent"] >= 30  # a class that spoke, before and after the kill
    assert report["lost"] == 0 and report["duplicates"] == 0 and report["copies"] == 0
    assert report["transcripts_received"] == report["utterances_sent"]
    # The feeds go on: transcripts arrive well after the failover (the cluster's node timeout
    # and the promotion take a few seconds).
    timeline = report["timeline"]
    at_kill = max((row["transcripts_received"] for row in timeline if row["t"] <= killed_at), default=0)
    after = [row for row in timeline if row["t"] >= killed_at + 8]
    assert after and after[-1]["transcripts_received"] >= at_kill + 10, (at_kill, after[-1:])


def _rooms_by_primary(servers: RedisClusterServers) -> dict[int, int]:
    """Live primary port -> how many rooms' records it holds."""
    layout = KeyLayout(CLUSTER_SHARDS)
    counts = {}
    for port in servers.primaries():
        client = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
        try:
            counts[port] = sum(1 for key in client.scan_iter(match="*room:*:meta", count=1000) if key.startswith(tuple(layout.tags)))
        finally:
            client.close()
    return counts


def test_a_class_on_a_redis_cluster_loses_nothing_when_a_primary_dies(tmp_path):
    with RedisClusterServers(primaries=3) as servers:
        killed: dict[str, object] = {}

        def kill() -> int:
            killed["rooms"] = _rooms_by_primary(servers)  # every room is created by now (the students joined)
            victim = max(killed["rooms"], key=killed["rooms"].get)  # the primary with the most rooms
            killed["victim"] = victim
            return servers.kill_primary(victim)

        report, killed_at, promoted = run_class(tmp_path, servers.url, kill)
        print("rooms per primary before the kill:", killed["rooms"], "killed", killed["victim"], "promoted", promoted)
        rooms = killed["rooms"]
        assert len(rooms) == 3 and all(n >= 1 for n in rooms.values()), rooms  # rooms on every shard
        assert sum(rooms.values()) == ROOMS
        assert promoted != killed["victim"] and promoted in servers.primaries()  # the replica serves its slots now
        assert _rooms_by_primary(servers)[promoted] >= rooms[killed["victim"]]  # nothing of its rooms lost
        check_exactly_once(report, killed_at)


def test_a_class_on_sentinels_loses_nothing_when_the_primary_dies(tmp_path):
    with RedisSentinelServers() as servers:
        first = servers.master_port()
        report, killed_at, promoted = run_class(tmp_path, servers.url, servers.kill_primary)
        assert first == servers.primary.port and promoted == servers.replica.port == servers.master_port()
        check_exactly_once(report, killed_at)
