"""One way to open a Redis client from a URL, for the bus and the job queue alike.

`redis://[user:password@]host:port/db` or, over the internet uplink of an on-prem gateway,
`rediss://` (TLS): the server's certificate is verified against the system's CAs, or against
`ca_file` (`--redis-ca`, for a deployment's own CA). Redis ACL users come in the URL.

Replicated deployments (docs/redis.md), through redis-py's own clients:
- `redis+cluster://[user:password@]host:port[,host:port...]` (`rediss+cluster://` for TLS): a
  Redis Cluster, any of its nodes (the rest are discovered); keys are laid out per shard
  (bus/keys.py KeyLayout) so that each Lua script touches one slot;
- `redis+sentinel://[user:password@]host:port[,host:port...]/MASTER` (`rediss+sentinel://`): the
  primary that the Sentinels name MASTER, followed through their failovers; the credentials are
  the primary's (the Sentinels are asked without).
On both, a write that must survive the primary's death is confirmed by a replica (`WAIT`) before
it is relied on (Replication below): Redis replicates asynchronously, and a failover loses
what the replica had not yet received.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.commands.core import AsyncScript
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError, ResponseError, SlotNotCoveredError

from streamserver.bus import redis_compat

redis_compat.install()  # a connection closed under a write is a ConnectionError (bus/redis_compat.py)

MAX_CONNECTIONS = 2048
# Connection trouble as raised by redis-py (a cluster whose slots are being failed over raises
# RedisClusterException, which is no RedisError) and by the socket layer under it.
REDIS_FAILURES: tuple[type[BaseException], ...] = (RedisError, OSError, RedisClusterException)
# How long a write waits for a replica's confirmation. Past it the primary is asked whether it
# has a replica at all: one that is only behind makes the write fail (ReplicaBehind: the caller
# retries, as for any Redis failure); none (its replica died, or was promoted and the old
# primary is gone) and the primary is written to unconfirmed for NO_REPLICA_RECHECK_S before it
# is asked again.
WAIT_TIMEOUT_MS = 500
NO_REPLICA_RECHECK_S = 5.0

AnyRedis = aioredis.Redis | RedisCluster


class ReplicaBehind(RedisError):
    """A write the primary took but its replica did not confirm in time: not yet safe."""
Topology = Literal["single", "cluster", "sentinel"]


@dataclass(frozen=True)
class RedisAddress:
    """What a Redis URL names: the topology, the hosts, the credentials, TLS, the database or the
    Sentinel master name."""

    topology: Topology
    hosts: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    tls: bool
    master: str = ""


def parse_replicated(url: str) -> RedisAddress | None:
    """The address of a `redis+cluster://` or `redis+sentinel://` URL; None for any other URL
    (redis-py's from_url reads those)."""
    scheme, sep, rest = url.partition("://")
    base, plus, topology = scheme.partition("+")
    if not sep or not plus:
        return None
    if base not in ("redis", "rediss") or topology not in ("cluster", "sentinel"):
        raise ValueError(f"unknown Redis URL scheme {scheme!r}: redis[s]+cluster:// or redis[s]+sentinel://")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    hosts = []
    for item in hostlist.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{redacted(url)}: each node is HOST:PORT, not {item!r}")
        hosts.append((host.strip("[]"), int(port)))
    master = path.split("?")[0].strip("/")
    if topology == "sentinel" and not master:
        raise ValueError(f"{redacted(url)}: a Sentinel URL ends in /MASTER_NAME")
    if topology == "cluster" and master not in ("", "0"):
        raise ValueError(f"{redacted(url)}: a Redis Cluster has database 0 only")
    return RedisAddress(topology, tuple(hosts), username, password, base == "rediss", master)  # type: ignore[arg-type]


def topology(url: str) -> Topology:
    address = parse_replicated(url)
    return "single" if address is None else address.topology


def redacted(url: str) -> str:
    """The URL fit for a log line: its password replaced."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if "+" in scheme and sep:  # several hosts: urlsplit cannot read the netloc
        if not at or ":" not in userinfo:
            return url
        return f"{scheme}://{userinfo.partition(':')[0]}:***@{hosts}{slash}{path}"
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redis_client(url: str, ca_file: str | None = None, **options: Any) -> AnyRedis:
    # redis-py's asyncio pool allows 100 connections and then raises "Too many connections": a
    # gateway with hundreds of students has more publishes and seat calls in flight than that
    # when a class ends at once (250 students a gateway).
    options.setdefault("max_connections", MAX_CONNECTIONS)
    address = parse_replicated(url)
    tls = address.tls if address is not None else url.startswith("rediss://")
    if ca_file:
        if not tls:
            raise ValueError("--redis-ca is for a TLS Redis: its URL starts with rediss://")
        options["ssl_ca_certs"] = ca_file
    if address is None:
        return aioredis.Redis.from_url(url, **options)
    if tls:
        options["ssl"] = True
    credentials = {"username": address.username, "password": address.password}
    if address.topology == "cluster":
        # The cluster client refreshes its slot map on a MOVED or a dead node and retries
        # with `retry` itself; a failover still takes the cluster's node timeout, during which
        # callers get a failure and retry as they do with a single Redis that is away.
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in address.hosts],
                            **credentials, **options)
    sentinel_options = {k: v for k, v in options.items() if k.startswith(("socket_", "ssl"))}
    sentinel = Sentinel(list(address.hosts), sentinel_kwargs=sentinel_options, **options, **credentials)
    return sentinel.master_for(address.master, redis_class=aioredis.Redis, **options, **credentials)


def is_cluster(client: AnyRedis) -> bool:
    return isinstance(client, RedisCluster)


class Replication:
    """Writes confirmed by a replica: a Lua script and `WAIT 1` sent together on one connection
    (WAIT counts the replicas that have this connection's writes), to the primary of the
    script's slot. A write whose replica is behind raises ReplicaBehind; a primary with no
    replica at all is written to without waiting for a while: there is nothing to fail over
    to, and waiting would only slow every write. With `enabled` False (a single Redis) a script
    is simply evaluated."""

    def __init__(self, client: AnyRedis, enabled: bool) -> None:
        self.client, self.enabled = client, enabled
        self._alone_until: dict[str, float] = {}  # primary -> until when it is taken to have no replica

    async def run(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The script's reply (a script registered on the client), once a replica holds its
        writes (where there is one)."""
        if not self.enabled:
            return await script(keys=keys, args=args)
        target: dict[str, Any] = {}
        name = "primary"
        if isinstance(self.client, RedisCluster):
            try:
                node = self.client.get_node_from_key(keys[0])
            except SlotNotCoveredError:  # no slot map yet (the client's first command), or a stale one
                await self.client.initialize()
                node = self.client.get_node_from_key(keys[0])
            name, target = node.name, {"target_nodes": node}
        if time.monotonic() < self._alone_until.get(name, 0.0):
            return await script(keys=keys, args=args)
        return (await self._confirmed(script, [(keys, args)], name, target))[0]

    async def run_many(self, script: AsyncScript, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> list[Any]:
        """Several calls of one script (keys, args), each of one slot: one round trip per primary,
        its calls and one `WAIT 1` on one connection, the primaries side by side; a reply per
        call, in order, or the exception that its primary's round trip raised (the others'
        replies stand). Disabled (a single Redis): the calls in one pipeline."""
        if not self.enabled:
            return await self._pipelined(script, calls)
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, (keys, _args) in enumerate(calls):
            node: Any = None
            name = "primary"
            if isinstance(self.client, RedisCluster):
                try:
                    node = self.client.get_node_from_key(keys[0])
                except SlotNotCoveredError:
                    await self.client.initialize()
                    node = self.client.get_node_from_key(keys[0])
                name = node.name
            by_node.setdefault(name, (node, []))[1].append(i)
        replies: list[Any] = [None] * len(calls)

        async def on(name: str, node: Any, indexes: list[int]) -> None:
            try:
                chosen = [calls[i] for i in indexes]
                if time.monotonic() < self._alone_until.get(name, 0.0):
                    got = await self._pipelined(script, chosen)
                else:
                    got = await self._confirmed(script, chosen, name, {"target_nodes": node} if node is not None else {})
            except REDIS_FAILURES as error:
                got = [error] * len(indexes)
            for i, reply in zip(indexes, got):
                replies[i] = reply

        await asyncio.gather(*(on(name, node, indexes) for name, (node, indexes) in by_node.items()))
        return replies

    async def _pipelined(self, script: AsyncScript, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> list[Any]:
        if len(calls) == 1:
            return [await script(keys=calls[0][0], args=calls[0][1])]
        pipe = self.client.pipeline(transaction=False)
        for keys, args in calls:  # EVAL: as _confirmed
            pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
        return list(await pipe.execute())

    async def _confirmed(self, script: AsyncScript, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]], name: str,
                         target: dict[str, Any]) -> list[Any]:
        """The calls and a WAIT on one connection to one primary. EVAL, not EVALSHA: a replica just
        promoted has no script cache, and a cluster pipeline refuses EVALSHA."""
        pipe = self.client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
        pipe.execute_command("WAIT", 1, WAIT_TIMEOUT_MS, **target)
        *got, replicas = await pipe.execute()
        if int(replicas) < 1:
            info = await self.client.info("replication", **target)
            if int(info.get("connected_slaves", 0)) > 0:
                raise ReplicaBehind(f"no replica of {name} confirmed a write within {WAIT_TIMEOUT_MS} ms")
            self._alone_until[name] = time.monotonic() + NO_REPLICA_RECHECK_S
        return got


async def check_credentials(url: str, ca_file: str | None = None) -> str | None:
    """Why this process cannot use the Redis at `url` at all (a wrong password or user, a
    certificate that does not verify), or None. A Redis that is merely down is not a reason:
    gateways and workers wait for it."""
    client = redis_client(url, ca_file, socket_connect_timeout=5, socket_timeout=5)
    try:
        await client.ping()
    except AuthenticationError as error:
        return f"Redis refused the credentials in the URL: {error}"
    except ResponseError as error:  # NOAUTH, NOPERM ...
        return f"Redis refused this client: {error}"
    except REDIS_FAILURES as error:
        if "certificate" in str(error).lower() or "ssl" in type(error).__name__.lower():
            return f"TLS to Redis failed: {error}"
        return None
    finally:
        await client.aclose()
    return None
