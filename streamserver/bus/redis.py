"""Redis bus: PUBLISH for live delivery, a capped stream per room for replay; several server
processes share rooms through it.

Keys: channel `room:<id>` (pub/sub) and stream `room:<id>:history` (field "event").
The hiredis parser is used: redis-py picks it by default whenever hiredis is installed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import AsyncIterator

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError

from streamserver.events import room_channel

log = logging.getLogger(__name__)

# Connection trouble as raised by redis-py and by the socket layer under it.
_FAILURES = (RedisError, OSError)


class BusError(RuntimeError):
    """The bus could not do what was asked: Redis unreachable, connection lost, an error reply."""


def history_key(room_id: str) -> str:
    return f"{room_channel(room_id)}:history"


class RedisBus:
    def __init__(
        self,
        url: str,
        history_len: int = 500,
        *,
        backoff_min_s: float = 0.1,
        backoff_max_s: float = 5.0,
        poll_s: float = 1.0,
    ) -> None:
        self._history_len = history_len
        self._backoff_min_s = backoff_min_s
        self._backoff_max_s = backoff_max_s
        self._poll_s = poll_s  # how soon a subscriber notices close()
        self._closed = False
        self._redis = aioredis.Redis.from_url(
            url,
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

    async def publish(self, room_id: str, event_json: str) -> None:
        # One round trip; no MULTI: live delivery and history need no atomicity between them.
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.publish(room_channel(room_id), event_json)
                pipe.xadd(
                    history_key(room_id),
                    {"event": event_json},
                    maxlen=self._history_len,
                    approximate=True,  # "~": trims whole radix nodes, cheaper than an exact cap
                )
                await pipe.execute()
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
        channel = room_channel(room_id)
        delay = self._backoff_min_s
        lost = False
        mark: str | None = None  # history stream position up to which this subscriber is served
        delivered: collections.deque[str] = collections.deque(maxlen=max(self._history_len, 1))
        while not self._closed:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                if mark is None:
                    mark = await self._history_end(room_id)
                if lost:
                    log.info("resubscribed to %s", channel)
                    lost = False
                    missed, mark = await self._history_after(room_id, mark)
                    seen = set(delivered)
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
                        delivered.append(message["data"])
                        yield message["data"]
            except _FAILURES as e:
                if self._closed:  # close() tore the connection down under us
                    return
                lost = True
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

    async def _history_end(self, room_id: str) -> str:
        newest = await self._redis.xrevrange(history_key(room_id), count=1)
        return newest[0][0] if newest else "0-0"

    async def _history_after(self, room_id: str, mark: str) -> tuple[list[str], str]:
        """History entries after `mark` (oldest first) and the new mark."""
        entries = await self._redis.xrange(history_key(room_id), min=f"({mark}", max="+")
        return [fields["event"] for _id, fields in entries], (entries[-1][0] if entries else mark)

    async def history(self, room_id: str, limit: int = 200) -> list[str]:
        # MAXLEN ~ may keep a few more than history_len; cap here so both buses agree.
        count = min(limit, self._history_len)
        if count <= 0:
            return []
        try:
            entries = await self._redis.xrevrange(history_key(room_id), count=count)
        except _FAILURES as e:
            raise BusError(f"history of room {room_id!r} failed: {e}") from e
        return [fields["event"] for _id, fields in reversed(entries)]

    async def subscriber_count(self, room_id: str) -> int:
        """Subscribers of the room across every process (PUBSUB NUMSUB)."""
        try:
            [(_channel, count)] = await self._redis.pubsub_numsub(room_channel(room_id))
        except _FAILURES as e:
            raise BusError(f"subscriber count of room {room_id!r} failed: {e}") from e
        return int(count)

    async def save_room(self, room_id: str, meta: dict[str, str]) -> None:
        try:
            await self._redis.hset(f"{room_channel(room_id)}:meta", mapping=meta)
        except _FAILURES as e:
            raise BusError(f"saving room {room_id!r} failed: {e}") from e

    async def load_room(self, room_id: str) -> dict[str, str] | None:
        try:
            meta = await self._redis.hgetall(f"{room_channel(room_id)}:meta")
        except _FAILURES as e:
            raise BusError(f"loading room {room_id!r} failed: {e}") from e
        return meta or None

    async def ping(self) -> bool:
        """Health check: True when Redis answers; never raises."""
        try:
            return bool(await self._redis.ping())
        except _FAILURES:
            return False

    async def close(self) -> None:
        self._closed = True
        await self._redis.aclose()  # closes the pool too: the client created it (from_url)
