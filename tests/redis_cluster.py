"""Real replicated Redis deployments for tests: a Redis Cluster (primaries with one replica each)
and a Sentinel set (one primary, one replica, three sentinels), every process a Debian
redis-server started on free local ports and stopped at the end. A primary can be SIGKILLed and
the helper waits until its replica has taken over, as a deployment's would.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis
from redis.exceptions import RedisError

from tests.redis_server import free_port

NODE_TIMEOUT_MS = 1000  # a primary silent this long is failed over (cluster-node-timeout, down-after-milliseconds)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher, where Redis puts it) is free too: Redis
    refuses ports above 55535 for that reason, so the OS's pick (often higher) will not do."""
    for _ in range(1000):
        port = random.randint(20000, 55000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def cluster_tools_missing() -> str | None:
    """Why a Redis Cluster cannot be started here (Debian's redis-server and redis-cli), or None."""
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH: install Debian's redis-server and redis-tools"
    return None


def cluster_settled(nodes) -> bool:  # noqa: ANN001 - nodes with .alive and .ask(*command)
    """Every live node sees the cluster ok, and every replica is linked to its primary."""
    for node in nodes:
        if not node.alive:
            continue
        if "cluster_state:ok" not in node.ask("CLUSTER", "INFO"):
            return False
        role = node.ask("ROLE")
        if role[0] == "slave" and role[3] != "connected":
            return False
    return True


class _Node:
    """One redis-server process with its own directory and log."""

    def __init__(self, directory: Path, args: list[str], port: int | None = None) -> None:
        self.port = port or free_port()
        self.directory = directory / str(self.port)
        self.directory.mkdir(parents=True)
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.directory / "log"

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(["redis-server", *self.args], cwd=self.directory, stdout=log,
                                         stderr=subprocess.STDOUT)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=2,
                           decode_responses=True)

    def ask(self, *command: str):  # noqa: ANN201 - a Redis reply
        """One command on a connection of its own."""
        client = self.client()
        try:
            return client.execute_command(*command)
        finally:
            client.close()

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        def answers() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on {self.port} exited:\n{self.log.read_text()[-3000:]}")
            return bool(self.ask("PING"))

        _wait(answers, timeout_s, f"redis-server on {self.port} to answer")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the host dies, nothing is flushed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001 - a callable returning a bool
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


class _Deployment:
    """Its nodes' processes and their directory, stopped and removed at the end."""

    def __init__(self, prefix: str) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.nodes: list[_Node] = []

    def start(self) -> _Deployment:
        for node in self.nodes:
            node.start()
        for node in self.nodes:
            node.wait_ready()
        return self

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self):  # noqa: ANN204 - the deployment itself
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class RedisClusterServers(_Deployment):
    """`primaries` primaries, each with one replica, slots spread evenly (`redis-cli --cluster
    create`). No persistence: a killed primary's data lives on in its replica only, so that what
    asynchronous replication loses in a failover is really lost."""

    def __init__(self, primaries: int = 3) -> None:
        super().__init__("redis-cluster-")
        for _ in range(2 * primaries):
            node = _Node(self._dir, [], free_cluster_port())
            node.args = ["--bind", "127.0.0.1", "--port", str(node.port), "--cluster-enabled", "yes",
                         "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                         "--cluster-replica-validity-factor", "0", "--save", "", "--appendonly", "no"]
            self.nodes.append(node)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisClusterServers:
        super().start()
        create = subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                                 "--cluster-replicas", "1", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{create.stdout[-3000:]}{create.stderr[-3000:]}")
        _wait(self._settled, 30, "the cluster to be ok on every node with every replica in sync")
        return self

    def _settled(self) -> bool:
        return cluster_settled(self.nodes)

    def primaries(self) -> dict[int, tuple[int, int]]:
        """Port of each live primary -> the (first, last) of its slot ranges, as a live node sees it."""
        shards = next(n for n in self.nodes if n.alive).ask("CLUSTER", "SLOTS")
        return {int(entry[2][1]): (int(entry[0]), int(entry[1])) for entry in shards}

    def owner(self, slot: int) -> int:
        """The port of the primary serving `slot`."""
        for entry in next(n for n in self.nodes if n.alive).ask("CLUSTER", "SLOTS"):
            if int(entry[0]) <= slot <= int(entry[1]):
                return int(entry[2][1])
        raise LookupError(f"slot {slot} is not served")

    def node(self, port: int) -> _Node:
        return next(n for n in self.nodes if n.port == port)

    def kill_primary(self, port: int, timeout_s: float = 30.0) -> int:
        """SIGKILL the primary on `port`; once its replica serves its slots, that replica's port."""
        slots = self.primaries()[port]
        self.node(port).kill()

        def promoted() -> bool:
            return self._owner_seen_by_all(slots[0]) not in (None, port)

        _wait(promoted, timeout_s, f"the replica of {port} to be promoted")
        return self.owner(slots[0])

    def _owner_seen_by_all(self, slot: int) -> int | None:
        owners = set()
        for node in self.nodes:
            if not node.alive:
                continue
            if "cluster_state:ok" not in node.ask("CLUSTER", "INFO"):
                return None
            owners |= {int(e[2][1]) for e in node.ask("CLUSTER", "SLOTS") if int(e[0]) <= slot <= int(e[1])}
        return owners.pop() if len(owners) == 1 else None


class RedisSentinelServers(_Deployment):
    """One primary, one replica and three sentinels (`redis-server --sentinel`, quorum 2) that
    fail the primary over to the replica once it is silent NODE_TIMEOUT_MS."""

    MASTER = "classroom"

    def __init__(self) -> None:
        super().__init__("redis-sentinel-")
        # DEBUG SLEEP stalls the replica in tests (Redis 7 refuses DEBUG unless enabled)
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--enable-debug-command", "yes"]
        self.primary = _Node(self._dir, [])
        self.primary.args = ["--port", str(self.primary.port), *common]
        self.replica = _Node(self._dir, [])
        self.replica.args = ["--port", str(self.replica.port), "--replicaof", "127.0.0.1", str(self.primary.port), *common]
        self.sentinels: list[_Node] = []
        for _ in range(3):
            node = _Node(self._dir, [])
            config = node.directory / "sentinel.conf"
            config.write_text(
                f"port {node.port}\nbind 127.0.0.1\n"
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {self.MASTER} {NODE_TIMEOUT_MS}\n"
                f"sentinel failover-timeout {self.MASTER} 10000\n"
                f"sentinel parallel-syncs {self.MASTER} 1\n")
            node.args = [str(config), "--sentinel"]
            self.sentinels.append(node)
        self.nodes = [self.primary, self.replica, *self.sentinels]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{n.port}" for n in self.sentinels) + f"/{self.MASTER}"

    def start(self) -> RedisSentinelServers:
        super().start()
        _wait(self._settled, 30, "the replica to be in sync and every sentinel to know it")
        return self

    def _settled(self) -> bool:
        if self.replica.ask("ROLE")[3] != "connected":
            return False
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                if int(client.sentinel_master(self.MASTER)["num-other-sentinels"]) < 2:
                    return False
                if not client.sentinel_slaves(self.MASTER):
                    return False
            finally:
                client.close()
        return True

    def master_port(self) -> int:
        return int(self.sentinels[0].ask("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.MASTER)[1])

    def kill_primary(self, timeout_s: float = 30.0) -> int:
        """SIGKILL the primary; once every sentinel names the replica as the primary, its port."""
        self.primary.kill()

        def promoted() -> bool:
            if any(int(s.ask("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.MASTER)[1]) != self.replica.port
                   for s in self.sentinels):
                return False
            return self.replica.ask("ROLE")[0] == "master"

        _wait(promoted, timeout_s, "the sentinels to promote the replica")
        return self.replica.port
