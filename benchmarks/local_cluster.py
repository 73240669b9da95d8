"""A Redis Cluster on this host for benchmarks: K primaries, each with R replicas, every node a
redis-server started here and stopped at the end.

It is formed with plain cluster commands (CLUSTER MEET, ADDSLOTS, REPLICATE) rather than
`redis-cli --cluster create`, because benchmark hosts often carry redis-server alone (the GPU
host's comes from a wheel). Slots are split evenly in K contiguous ranges, as redis-cli does, so
each primary holds the same share of the deployment's shards (docs/redis.md). No persistence:
the replicas are what a deployment relies on (a job is queued once a replica holds it).

    with LocalCluster(primaries=3, replicas=1, directory=...) as cluster:
        cluster.url          # redis+cluster://127.0.0.1:P1,...
        cluster.cpu_seconds  # each node's used_cpu_user + used_cpu_sys (INFO cpu)
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from tests.redis_cluster import cluster_settled, free_cluster_port
from tests.redis_server import redis_server_binary

SLOTS = 16384


class Node:
    """One cluster node: a redis-server on its own port and directory."""

    def __init__(self, directory: Path, role: str, index: int) -> None:
        self.port = free_cluster_port()
        self.role, self.index = role, index  # "primary" or "replica"; the primary's index it serves
        self.directory = directory / f"{self.port}"
        self.directory.mkdir(parents=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"redis-{self.role}-{self.index}" + (f"@{self.port}" if self.role == "replica" else "")

    def start(self, binary: str) -> None:
        log = (self.directory / "log").open("ab")
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000", "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            cwd=self.directory, stdout=log, stderr=subprocess.STDOUT)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10, decode_responses=True)

    def ask(self, *command: object):  # noqa: ANN201 - a Redis reply
        with self.client() as c:
            return c.execute_command(*command)

    def log_tail(self) -> str:
        path = self.directory / "log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""


class LocalCluster:
    def __init__(self, primaries: int = 3, replicas: int = 1, directory: Path | None = None) -> None:
        if primaries < 1 or replicas < 0:
            raise ValueError("a cluster needs at least one primary (and no negative count of replicas)")
        self._owned = directory is None  # a directory given is the caller's (its nodes' logs stay)
        self.directory = directory or Path("/tmp") / f"local-cluster-{time.monotonic_ns()}"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.primaries = [Node(self.directory, "primary", i) for i in range(primaries)]
        self.replicas = [Node(self.directory, "replica", i) for i in range(primaries) for _ in range(replicas)]

    @property
    def nodes(self) -> list[Node]:
        return self.primaries + self.replicas

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.primaries)

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        binary = redis_server_binary()
        for node in self.nodes:
            node.start(binary)
        self._wait(lambda: all(self._answers(n) for n in self.nodes), timeout_s, "every node to answer PING")
        first = self.primaries[0]
        for node in self.nodes[1:]:
            first.ask("CLUSTER", "MEET", "127.0.0.1", node.port)
        k = len(self.primaries)
        for i, node in enumerate(self.primaries):
            lo, hi = i * SLOTS // k, (i + 1) * SLOTS // k - 1
            node.ask("CLUSTER", "ADDSLOTS", *range(lo, hi + 1))  # ADDSLOTSRANGE needs Redis 7
        self._wait(lambda: all(len(n.ask("CLUSTER", "NODES").splitlines()) == len(self.nodes) for n in self.nodes),
                   timeout_s, "every node to know every other")
        for node in self.replicas:
            primary_id = self.primaries[node.index].ask("CLUSTER", "MYID")
            node.ask("CLUSTER", "REPLICATE", primary_id)
        self._wait(self._settled, timeout_s, "the cluster to be ok with every replica in sync")
        return self

    @staticmethod
    def _answers(node: Node) -> bool:
        if node.proc is not None and node.proc.poll() is not None:
            raise RuntimeError(f"redis-server on {node.port} exited:\n{node.log_tail()}")
        try:
            return bool(node.ask("PING"))
        except redis.RedisError:
            return False

    def _settled(self) -> bool:
        return cluster_settled(self.nodes)

    @staticmethod
    def _wait(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001 - a callable returning a bool
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.2)

    def cpu_seconds(self) -> dict[str, float]:
        """Each live node's CPU seconds so far (its main thread and the rest, user and system)."""
        used = {}
        for node in self.nodes:
            try:
                info = node.client().info("cpu")
            except redis.RedisError:
                continue
            used[node.name] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        return used

    def pids(self) -> dict[str, int]:
        return {n.name: n.proc.pid for n in self.nodes if n.proc is not None}

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is not None:
                try:
                    node.proc.wait(10)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
