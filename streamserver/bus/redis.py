"""Redis bus: PUBLISH for live delivery, a capped stream per room for replay; several server
processes share rooms through it.

Keys (streamserver/bus/keys.py): the room's channel, its history stream, its record and its
seats; seat leases are in ms of Redis's own clock, so the processes' clocks never matter, and
the seat keys expire with their last lease.
The hiredis parser is used: redis-py picks it by default whenever hiredis is installed.
On a Redis Cluster (bus/connect.py) a room's keys share its shard's hash tag (keys.KeyLayout), so
that each script here touches one slot; its events go out with plain PUBLISH, which the cluster
carries to every node, so a subscriber connected to any node gets them: the bus's subscriptions
share a plain connection pool to one node, and move to another when that node fails.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import AsyncIterator

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster

from streamserver.bus.connect import REDIS_FAILURES, is_cluster, redis_client, topology
from streamserver.config import Settings
from streamserver.bus.keys import CLUSTER_SHARDS, HISTORY_FIELD, TRANSCRIPT_RETENTION_S, KeyLayout, is_final_transcript

log = logging.getLogger(__name__)

_FAILURES = REDIS_FAILURES


class BusError(RuntimeError):
    """The bus could not do what was asked: Redis unreachable, connection lost, an error reply."""


# Redis's own clock, in ms: `now` for the seat scripts below.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# KEYS[1] the room's seats (student -> end of its longest lease), KEYS[2] its leases (student ->
# JSON {holder: lease end}), KEYS[3] the seated students' names (the roster of every gateway's
# students): a student seated through two gateways (a reconnect) holds one seat until both let
# go. Times are Redis's clock (ms). Expired seats go first; the keys live as long as their
# longest lease.
_SEATS = _NOW + """
for _, student in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('HDEL', KEYS[2], student)
  redis.call('HDEL', KEYS[3], student)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local function hold(student, holder, expiry)  -- expiry nil: holder lets go
  local raw = redis.call('HGET', KEYS[2], student)
  local leases = raw and cjson.decode(raw) or {}
  leases[holder] = expiry
  local live, last = {}, nil
  for h, e in pairs(leases) do
    if e > now then
      live[h] = e
      if not last or e > last then last = e end
    end
  end
  if last then
    redis.call('HSET', KEYS[2], student, cjson.encode(live))
    redis.call('ZADD', KEYS[1], last, student)
  else
    redis.call('HDEL', KEYS[2], student)
    redis.call('HDEL', KEYS[3], student)
    redis.call('ZREM', KEYS[1], student)
  end
end
local function keep()
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIREAT', KEYS[1], last[2])
    redis.call('PEXPIREAT', KEYS[2], last[2])
    redis.call('PEXPIREAT', KEYS[3], last[2])
  end
end
"""
# ARGV: student, limit, lease_ms, holder, name -> 1 seated (or renewed: a reconnect), 0 room full
_TAKE_SEAT = _SEATS + """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
hold(ARGV[1], ARGV[4], now + tonumber(ARGV[3]))
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[5])
end
keep()
return 1
"""
# Every student with a live seat and their name: student, name, student, name... (read only: an
# expired seat is skipped here and dropped by the next script that writes).
_SEATED = _NOW + """
local names = {}
local flat = redis.call('HGETALL', KEYS[3])
for i = 1, #flat, 2 do
  names[flat[i]] = flat[i + 1]
end
local out = {}
for _, student in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')) do
  out[#out + 1] = student
  out[#out + 1] = names[student] or ''
end
return out
"""
# Every student with a live seat, without the names (read only): a fifth of _SEATED's time.
_SEAT_IDS = _NOW + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
"""
# How many seats have a live lease (read only): O(log n), whatever the room's size.
_SEAT_COUNT = _NOW + """
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
"""
# ARGV: lease_ms, holder, then student, name for each (a seat that expired meanwhile is taken
# again, with its name: its first seat's went with it)
_RENEW_SEATS = _SEATS + """
local expiry = now + tonumber(ARGV[1])
for i = 3, #ARGV, 2 do
  local seated = redis.call('ZSCORE', KEYS[1], ARGV[i])
  hold(ARGV[i], ARGV[2], expiry)
  if not seated and ARGV[i + 1] ~= '' then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  end
end
keep()
return 0
"""
# ARGV: student, holder
_RELEASE_SEAT = _SEATS + """
hold(ARGV[1], ARGV[2], nil)
keep()
return 0
"""


# A batch of one room's events: each published, a kept one appended to the history, a final also
# to the class transcript. One script, so that a batch is one round trip to the room's one slot
# (a cluster pipeline refuses PUBLISH). KEYS: history, transcript; ARGV: channel, history length,
# history field, retention, then for each event: the event, kept (1/0), a final (1/0).
PUBLISH_MANY_LUA = """
local finals = false
for i = 5, #ARGV, 3 do
  redis.call('PUBLISH', ARGV[1], ARGV[i])
  if ARGV[i + 1] == '1' then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', ARGV[3], ARGV[i])
    if ARGV[i + 2] == '1' then
      redis.call('RPUSH', KEYS[2], ARGV[i])
      finals = true
    end
  end
end
if finals then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
return 0
"""
# The room's record replaced and given its expiry at once. KEYS: meta; ARGV: ttl ms, field, value...
_SAVE_ROOM = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 0
"""


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class RedisBus:
    def __init__(
        self,
        url: str,
        history_len: int = 500,
        *,
        backoff_min_s: float = 0.1,
        backoff_max_s: float = 5.0,
        poll_s: float = 1.0,
        ca_file: str | None = None,
        transcript_retention_s: int = TRANSCRIPT_RETENTION_S,
        prefix: str = Settings.redis_prefix,
    ) -> None:
        self._history_len = history_len
        self._retention_s = transcript_retention_s
        self._backoff_min_s = backoff_min_s
        self._backoff_max_s = backoff_max_s
        self._poll_s = poll_s  # how soon a subscriber notices close()
        self._closed = False
        self._redis = redis_client(
            url,
            ca_file,
            decode_responses=True,
            # A publish on a dead server should fail within about a second, not stall the ASR
            # worker for redis-py's default 10 retries: the caller decides what to do on BusError.
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=3),
            socket_connect_timeout=5,
            socket_timeout=5,
            socket_keepalive=True,
            # PINGs idle pub/sub connections too, so a silently dead link is noticed.
            health_check_interval=30,
        )
        self._cluster = is_cluster(self._redis)
        self.keys = KeyLayout(CLUSTER_SHARDS if topology(url) == "cluster" else 1, prefix)
        self._node_turn = 0  # which of the cluster's nodes the subscriptions use now
        self._node_client: aioredis.Redis | None = None  # a plain client of that node
        self._node_clients: list[aioredis.Redis] = []  # every one made, closed by close()
        self._publish_many = self._redis.register_script(PUBLISH_MANY_LUA)
        self._save_room = self._redis.register_script(_SAVE_ROOM)
        self._take_seat = self._redis.register_script(_TAKE_SEAT)
        self._renew_seats = self._redis.register_script(_RENEW_SEATS)
        self._release_seat = self._redis.register_script(_RELEASE_SEAT)
        self._seated = self._redis.register_script(_SEATED)
        self._seat_ids = self._redis.register_script(_SEAT_IDS)
        self._seat_count = self._redis.register_script(_SEAT_COUNT)

    async def publish(self, room_id: str, event_json: str, keep: bool = True) -> None:
        await self.publish_many(room_id, [(event_json, keep)])

    async def publish_many(self, room_id: str, events: list[tuple[str, bool]]) -> None:
        # One round trip. The history is capped with "~": trims whole radix nodes, cheaper than an
        # exact cap; a final also goes to the class transcript (the whole class, for the export).
        args: list[str | int] = [self.keys.room_channel(room_id), self._history_len, HISTORY_FIELD, self._retention_s]
        for event_json, keep in events:
            args += [event_json, int(keep), int(keep and is_final_transcript(event_json))]
        try:
            await self._publish_many(keys=[self.keys.history(room_id), self.keys.transcript(room_id)], args=args)
        except _FAILURES as e:
            raise BusError(f"publish to room {room_id!r} failed: {e}") from e

    async def subscribe(self, room_id: str) -> AsyncIterator[str]:
        """Events published from the first __anext__ on (once SUBSCRIBE is acknowledged).

        Survives connection loss: resubscribes with exponential backoff, logging it, then replays
        from the room's history what was published while it was away (pub/sub keeps nothing),
        skipping what it had already delivered. Ends on close(). Use `async with
        contextlib.aclosing(bus.subscribe(room))` so that leaving the loop unsubscribes at once
        rather than at garbage collection.
        """
        channel = self.keys.room_channel(room_id)
        delay = self._backoff_min_s
        lost = False
        mark: str | None = None  # history stream position up to which this subscriber is served
        delivered: collections.deque[str] = collections.deque(maxlen=max(self._history_len, 1))
        replayed: collections.Counter[str] = collections.Counter()  # replayed, may still come by pub/sub
        while not self._closed:
            pubsub, node = await self._pubsub()
            try:
                if mark is None:
                    # Read before SUBSCRIBE, so that an event published right after SUBSCRIBE whose
                    # message is lost with the connection (before it was read) is still replayed.
                    mark = await self._history_end(room_id)
                await pubsub.subscribe(channel)
                if lost:
                    log.info("resubscribed to %s", channel)
                    lost = False
                    missed, mark = await self._history_after(room_id, mark)
                    seen = set(delivered)
                    # An event published between SUBSCRIBE and this read arrives both ways: from
                    # the history here and as a pub/sub message below; the message is then skipped.
                    replayed = collections.Counter(event for event in missed if event not in seen)
                    for event in missed:
                        if event not in seen:
                            delivered.append(event)
                            yield event
                delay = self._backoff_min_s
                while not self._closed:
                    # A timeout rather than listen(): lets the loop notice close().
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=self._poll_s
                    )
                    if message is not None and message["type"] == "message":
                        if replayed[message["data"]]:
                            replayed[message["data"]] -= 1
                            continue
                        delivered.append(message["data"])
                        yield message["data"]
            except _FAILURES as e:
                if self._closed:  # close() tore the connection down under us
                    return
                lost = True
                if node is not None and node is self._node_client:  # the next subscription tries another node
                    self._node_client = None
                    self._node_turn += 1
                log.warning(
                    "subscription to %s lost (%s: %s); resubscribing in %.1fs",
                    channel,
                    type(e).__name__,
                    e,
                    delay,
                )
            finally:
                # Also runs on aclose()/cancel; the connection may already be dead.
                with contextlib.suppress(*_FAILURES):
                    await pubsub.aclose()
            if self._closed:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._backoff_max_s)

    async def _pubsub(self) -> tuple[PubSub, aioredis.Redis | None]:
        """A pub/sub of the room's channel, and on a cluster the node client it is on. A cluster's
        PUBLISH reaches every node, so any node will do: a plain client of one (redis-py's cluster
        pub/sub lends subscribed connections out of the node's command pool)."""
        if not isinstance(self._redis, RedisCluster):
            return self._redis.pubsub(ignore_subscribe_messages=True), None
        if self._node_client is None:
            if not self._redis.get_nodes():
                await self._redis.initialize()
            nodes = sorted(self._redis.get_nodes(), key=lambda n: n.name)
            node = nodes[self._node_turn % len(nodes)]
            options = {k: v for k, v in node.connection_kwargs.items() if k != "retry"}
            self._node_client = aioredis.Redis(
                connection_pool=aioredis.ConnectionPool(connection_class=node.connection_class, **options))
            self._node_clients.append(self._node_client)
        return self._node_client.pubsub(ignore_subscribe_messages=True), self._node_client

    async def _history_end(self, room_id: str) -> str:
        newest = await self._redis.xrevrange(self.keys.history(room_id), count=1)
        return newest[0][0] if newest else "0-0"

    async def _history_after(self, room_id: str, mark: str) -> tuple[list[str], str]:
        """History entries after `mark` (oldest first) and the new mark."""
        entries = await self._redis.xrange(self.keys.history(room_id), min=f"({mark}", max="+")
        return [fields[HISTORY_FIELD] for _id, fields in entries], (entries[-1][0] if entries else mark)

    async def history(self, room_id: str, limit: int = 200) -> list[str]:
        # MAXLEN ~ may keep a few more than history_len; cap here so both buses agree.
        count = min(limit, self._history_len)
        if count <= 0:
            return []
        try:
            entries = await self._redis.xrevrange(self.keys.history(room_id), count=count)
        except _FAILURES as e:
            raise BusError(f"history of room {room_id!r} failed: {e}") from e
        return [fields[HISTORY_FIELD] for _id, fields in reversed(entries)]

    async def transcript(self, room_id: str) -> list[str]:
        """Every final transcript of the room, in publish order (kept TRANSCRIPT_RETENTION_S
        after the last), not only the history's last history_len events."""
        try:
            return list(await self._redis.lrange(self.keys.transcript(room_id), 0, -1))
        except _FAILURES as e:
            raise BusError(f"reading the transcript of room {room_id!r} failed: {e}") from e

    async def subscriber_count(self, room_id: str) -> int:
        """Subscribers of the room across every process (PUBSUB NUMSUB; of every node of a
        cluster, as a subscriber is connected to any one)."""
        channel = self.keys.room_channel(room_id)
        try:
            if isinstance(self._redis, RedisCluster):
                replies = await self._redis.execute_command("PUBSUB NUMSUB", channel, target_nodes=RedisCluster.ALL_NODES)
                return sum(int(count) for _channel, count in replies)
            [(_channel, count)] = await self._redis.pubsub_numsub(channel)
        except _FAILURES as e:
            raise BusError(f"subscriber count of room {room_id!r} failed: {e}") from e
        return int(count)

    async def save_room(self, room_id: str, meta: dict[str, str], ttl_s: float) -> None:
        try:
            await self._save_room(keys=[self.keys.meta(room_id)],
                                  args=[_ms(ttl_s), *(item for pair in meta.items() for item in pair)])
        except _FAILURES as e:
            raise BusError(f"saving room {room_id!r} failed: {e}") from e

    async def touch_room(self, room_id: str, ttl_s: float) -> None:
        try:
            await self._redis.pexpire(self.keys.meta(room_id), _ms(ttl_s))
        except _FAILURES as e:
            raise BusError(f"keeping room {room_id!r} failed: {e}") from e

    async def load_room(self, room_id: str) -> dict[str, str] | None:
        try:
            meta = await self._redis.hgetall(self.keys.meta(room_id))
        except _FAILURES as e:
            raise BusError(f"loading room {room_id!r} failed: {e}") from e
        return meta or None

    async def take_seat(self, room_id: str, student_id: str, limit: int, lease_s: float, holder: str,
                        name: str = "") -> bool:
        try:
            return bool(await self._take_seat(keys=self.keys.seats(room_id),
                                              args=[student_id, limit, _ms(lease_s), holder, name]))
        except _FAILURES as e:
            raise BusError(f"no seat could be taken in room {room_id!r}: {e}") from e

    async def seated(self, room_id: str) -> dict[str, str]:
        try:
            flat = await self._seated(keys=self.keys.seats(room_id))
        except _FAILURES as e:
            raise BusError(f"reading the seats of room {room_id!r} failed: {e}") from e
        return dict(zip(flat[::2], flat[1::2]))

    async def seat_ids(self, room_id: str) -> set[str]:
        try:
            return set(await self._seat_ids(keys=self.keys.seats(room_id)[:1]))
        except _FAILURES as e:
            raise BusError(f"reading the seats of room {room_id!r} failed: {e}") from e

    async def seat_count(self, room_id: str) -> int:
        try:
            return int(await self._seat_count(keys=self.keys.seats(room_id)[:1]))
        except _FAILURES as e:
            raise BusError(f"counting the seats of room {room_id!r} failed: {e}") from e

    async def renew_seats(self, seats: dict[str, dict[str, str]], lease_s: float, holder: str) -> None:
        """One round trip for every room."""
        if not seats:
            return

        def args(students: dict[str, str]) -> list[str | int]:
            return [_ms(lease_s), holder, *(item for pair in students.items() for item in pair)]

        try:
            if self._cluster:  # rooms on several primaries: one script call each, side by side
                await asyncio.gather(*(self._renew_seats(keys=self.keys.seats(room_id), args=args(students))
                                       for room_id, students in seats.items()))
                return
            async with self._redis.pipeline(transaction=False) as pipe:
                for room_id, students in seats.items():
                    await self._renew_seats(keys=self.keys.seats(room_id), args=args(students), client=pipe)
                await pipe.execute()
        except _FAILURES as e:
            raise BusError(f"renewing seats failed: {e}") from e

    async def release_seat(self, room_id: str, student_id: str, holder: str) -> None:
        try:
            await self._release_seat(keys=self.keys.seats(room_id), args=[student_id, holder])
        except _FAILURES as e:
            raise BusError(f"releasing a seat in room {room_id!r} failed: {e}") from e

    async def ping(self) -> bool:
        """Health check: True when Redis answers; never raises."""
        try:
            return bool(await self._redis.ping())
        except _FAILURES:
            return False

    async def close(self) -> None:
        self._closed = True
        for client in self._node_clients:
            await client.aclose()
        await self._redis.aclose()  # closes the pool too: the client created it (from_url)
