"""Both buses against one contract; the Redis bus runs against a real redis-server.

Each test body is a coroutine run with asyncio.run (no pytest-asyncio); a bus is created and
closed inside it, since a redis.asyncio pool belongs to the event loop that used it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import aclosing
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Protocol, TypeVar

import pytest

from streamserver.bus.memory import MemoryBus
from streamserver.bus.keys import seat_keys
from streamserver.bus.redis import BusError, RedisBus
from tests.redis_server import RedisServer

T = TypeVar("T")
TIMEOUT_S = 5.0


class AnyBus(Protocol):
    async def publish(self, room_id: str, event_json: str) -> None: ...
    def subscribe(self, room_id: str) -> AsyncIterator[str]: ...
    async def history(self, room_id: str, limit: int = 200) -> list[str]: ...
    async def subscriber_count(self, room_id: str) -> int: ...
    async def take_seat(self, room_id: str, student_id: str, limit: int, lease_s: float, holder: str, name: str = "") -> bool: ...
    async def seated(self, room_id: str) -> dict[str, str]: ...
    async def seat_ids(self, room_id: str) -> set[str]: ...
    async def seat_count(self, room_id: str) -> int: ...
    async def renew_seats(self, seats: dict[str, dict[str, str]], lease_s: float, holder: str) -> None: ...
    async def release_seat(self, room_id: str, student_id: str, holder: str) -> None: ...
    async def close(self) -> None: ...


MakeBus = Callable[..., AnyBus]


@pytest.fixture(params=["memory", "redis"])
def make_bus(request: pytest.FixtureRequest) -> MakeBus:
    if request.param == "memory":
        return lambda history_len=500: MemoryBus(history_len)
    url: str = request.getfixturevalue("redis_url")  # only the Redis case starts a server
    return lambda history_len=500: RedisBus(url, history_len)


def room() -> str:
    # Tests share the session's redis-server: fresh room ids keep their channels and streams apart.
    return f"test-{uuid.uuid4().hex[:12]}"


def events(prefix: str, n: int) -> list[str]:
    return [f'{{"type": "transcript", "text": "{prefix}{i}"}}' for i in range(n)]


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(body(), 30))  # type: ignore[arg-type]


async def wait_subscribers(bus: AnyBus, room_id: str, n: int) -> None:
    """Subscription starts inside the generator: wait until the bus counts it before publishing."""
    async with asyncio.timeout(TIMEOUT_S):
        while await bus.subscriber_count(room_id) != n:
            await asyncio.sleep(0.01)


async def take(it: AsyncIterator[str], n: int, timeout_s: float = TIMEOUT_S) -> list[str]:
    async with asyncio.timeout(timeout_s):
        return [await anext(it) for _ in range(n)]


async def next_of(it: AsyncIterator[str]) -> str:
    return await anext(it)  # a coroutine, unlike anext()'s awaitable, so it can be a task


async def collect(bus: AnyBus, room_id: str, n: int) -> asyncio.Task[list[str]]:
    """A task reading n events of the room, returned once its subscription is live."""
    before = await bus.subscriber_count(room_id)

    async def reader() -> list[str]:
        async with aclosing(bus.subscribe(room_id)) as sub:
            return await take(sub, n)

    task = asyncio.create_task(reader())
    await wait_subscribers(bus, room_id, before + 1)
    return task


def test_delivery_in_publish_order(make_bus: MakeBus) -> None:
    async def body() -> None:
        bus, r = make_bus(), room()
        try:
            sent = events("e", 100)
            reader = await collect(bus, r, len(sent))
            for e in sent:
                await bus.publish(r, e)
            assert await reader == sent
        finally:
            await bus.close()

    run(body)


def test_room_isolation(make_bus: MakeBus) -> None:
    async def body() -> None:
        bus, a, b = make_bus(), room(), room()
        try:
            a_events, b_events = events("a", 20), events("b", 20)
            reader = await collect(bus, a, len(a_events) + 1)
            for ea, eb in zip(a_events, b_events):
                await bus.publish(b, eb)
                await bus.publish(a, ea)
            await bus.publish(a, "end")  # whatever of B could arrive has arrived before this
            assert await reader == a_events + ["end"]
            assert await bus.history(a) == a_events + ["end"]
            assert await bus.history(b) == b_events
        finally:
            await bus.close()

    run(body)


def test_history_capped_oldest_first(make_bus: MakeBus) -> None:
    async def body() -> None:
        bus, r = make_bus(history_len=5), room()
        try:
            assert await bus.history(r) == []
            sent = events("h", 12)
            for e in sent:
                await bus.publish(r, e)
            assert await bus.history(r) == sent[-5:]
            assert await bus.history(r, limit=3) == sent[-3:]
            assert await bus.history(r, limit=0) == []
        finally:
            await bus.close()

    run(body)


def test_unsubscribed_stops_receiving(make_bus: MakeBus) -> None:
    async def body() -> None:
        bus, r = make_bus(), room()
        try:
            leaver = bus.subscribe(r)
            first = asyncio.create_task(next_of(leaver))  # starts the subscription
            await wait_subscribers(bus, r, 1)
            stayer = await collect(bus, r, 2)
            await bus.publish(r, "one")
            assert await first == "one"
            await leaver.aclose()
            await wait_subscribers(bus, r, 1)  # unregistered on the bus, not only locally
            await bus.publish(r, "two")
            assert await stayer == ["one", "two"]
            with pytest.raises(StopAsyncIteration):
                await anext(leaver)
        finally:
            await bus.close()

    run(body)


def test_concurrent_subscribers_all_get_everything(make_bus: MakeBus) -> None:
    async def body() -> None:
        bus, r = make_bus(), room()
        try:
            sent = events("c", 50)
            readers = [await collect(bus, r, len(sent)) for _ in range(5)]

            async def publisher() -> None:
                for e in sent:
                    await bus.publish(r, e)
                    await asyncio.sleep(0)  # interleave with the readers

            await publisher()
            assert await asyncio.gather(*readers) == [sent] * 5
        finally:
            await bus.close()

    run(body)


def test_close_ends_subscribers(make_bus: MakeBus) -> None:
    async def body() -> None:
        bus, r = make_bus(), room()
        sub = bus.subscribe(r)
        pending = asyncio.create_task(next_of(sub))
        await wait_subscribers(bus, r, 1)
        await bus.close()
        with pytest.raises(StopAsyncIteration):
            async with asyncio.timeout(TIMEOUT_S):
                await pending

    run(body)


def test_seats_limit_reconnect_and_release(make_bus: MakeBus) -> None:
    """A room's seats, whichever gateway (holder) asks: full at the limit, a reconnect keeps its
    seat (and the gateway it came through holds it now), a release frees it for the next."""

    async def body() -> None:
        bus, r, other = make_bus(), room(), room()
        try:
            assert await bus.take_seat(r, "ann", 2, 30, "gw-a")
            assert await bus.take_seat(r, "bo", 2, 30, "gw-b")
            assert not await bus.take_seat(r, "cy", 2, 30, "gw-a")
            assert not await bus.take_seat(r, "cy", 2, 30, "gw-b")
            assert await bus.take_seat(other, "cy", 2, 30, "gw-a")  # rooms count apart
            assert await bus.take_seat(r, "ann", 2, 30, "gw-b")  # reconnects through gateway B
            await bus.release_seat(r, "ann", "gw-a")  # gateway A lets her go: B holds her seat now
            assert not await bus.take_seat(r, "cy", 2, 30, "gw-a")
            await bus.release_seat(r, "ann", "gw-b")
            await bus.release_seat(r, "nobody", "gw-b")  # releasing what is not held is harmless
            assert await bus.take_seat(r, "cy", 2, 30, "gw-a")
            assert not await bus.take_seat(r, "dee", 2, 30, "gw-a")
        finally:
            await bus.close()

    run(body)


def test_seated_is_the_whole_room_by_name(make_bus: MakeBus) -> None:
    """seated(): every student with a live seat, whichever gateway holds it, with the name given
    when it was taken; a released or expired seat is gone from it, a full room's refused student
    never appears, and a seat renewed after it expired (its gateway was cut off from the bus for
    longer than a lease) comes back with the name the renewal gives. seat_ids(): the same
    students without their names; seat_count(): how many."""
    lease = 1.0

    async def body() -> None:
        bus, r = make_bus(), room()

        async def seated(room_id: str) -> dict[str, str]:
            students = await bus.seated(room_id)
            assert await bus.seat_ids(room_id) == set(students)
            assert await bus.seat_count(room_id) == len(students)
            return students

        try:
            assert await seated(r) == {}
            assert await bus.take_seat(r, "bo", 3, lease, "gw-b", "Bo 王")
            assert await bus.take_seat(r, "ann", 3, 30, "gw-a", "Ann Lee")
            assert await bus.take_seat(r, "cy", 3, 30, "gw-b")  # no name given
            assert not await bus.take_seat(r, "dee", 3, 30, "gw-a", "Dee")  # full
            assert await seated(r) == {"ann": "Ann Lee", "bo": "Bo 王", "cy": ""}
            assert await bus.take_seat(r, "ann", 3, 30, "gw-b", "Ann L.")  # a reconnect, renamed
            await bus.release_seat(r, "cy", "gw-b")
            assert await seated(r) == {"ann": "Ann L.", "bo": "Bo 王"}
            await asyncio.sleep(lease + 0.2)  # bo's gateway stopped renewing
            assert await seated(r) == {"ann": "Ann L."}
            await bus.renew_seats({r: {"bo": "Bo 王", "ann": "ignored: still seated"}}, 30, "gw-b")
            assert await seated(r) == {"ann": "Ann L.", "bo": "Bo 王"}
            assert await seated(room()) == {}  # a room nobody sat in
        finally:
            await bus.close()

    run(body)


def test_seat_lease_expires_unless_renewed(make_bus: MakeBus) -> None:
    """A seat nobody renews (its gateway died) frees itself after its lease; a renewed one stays,
    and a seat renewed after it expired is taken again."""
    lease = 0.4

    async def body() -> None:
        bus, r = make_bus(), room()
        try:
            assert await bus.take_seat(r, "ann", 2, lease, "gw-a")
            assert await bus.take_seat(r, "bo", 2, lease, "gw-b")
            for _ in range(3):  # 0.6 s: ann renewed by gateway A, bo's gateway silent
                await asyncio.sleep(lease / 2)
                await bus.renew_seats({r: {"ann": "Ann"}}, lease, "gw-a")
            assert await bus.take_seat(r, "cy", 2, lease, "gw-b")
            assert not await bus.take_seat(r, "dee", 2, lease, "gw-b")
            await asyncio.sleep(lease + 0.1)  # every lease ran out
            await bus.renew_seats({r: {"ann": "Ann"}}, lease, "gw-a")  # ann is still on gateway A: seated again
            assert await bus.take_seat(r, "dee", 2, lease, "gw-b")
            assert not await bus.take_seat(r, "eve", 2, lease, "gw-b")
        finally:
            await bus.close()

    run(body)


def test_redis_seat_keys_expire_with_their_last_lease(redis_url: str) -> None:
    async def body() -> None:
        import redis.asyncio as aioredis

        bus, r = RedisBus(redis_url), room()
        client = aioredis.Redis.from_url(redis_url)
        try:
            assert await bus.take_seat(r, "ann", 5, 0.3, "gw-a", "Ann")
            assert await client.exists(*seat_keys(r)) == 3
            await asyncio.sleep(0.5)
            assert await client.exists(*seat_keys(r)) == 0  # nothing left behind by a dead gateway
        finally:
            await client.aclose()
            await bus.close()

    run(body)


def test_memory_slow_subscriber_is_disconnected(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        bus, r = MemoryBus(max_lag=10), room()
        slow = bus.subscribe(r)
        first = asyncio.create_task(next_of(slow))
        await wait_subscribers(bus, r, 1)
        sent = events("s", 31)
        fast = await collect(bus, r, len(sent))
        await bus.publish(r, sent[0])
        assert await first == sent[0]
        for e in sent[1:]:  # the slow one reads nothing more: 30 pending > max_lag
            await bus.publish(r, e)
            await asyncio.sleep(0)  # the fast one keeps up
        assert await fast == sent  # a slow peer doesn't hold back the others
        with pytest.raises(StopAsyncIteration):
            await anext(slow)
        assert await bus.subscriber_count(r) == 0
        await bus.close()

    with caplog.at_level(logging.WARNING, logger="streamserver.bus.memory"):
        run(body)
    assert "disconnecting" in caplog.text


def test_redis_survives_server_restart(caplog: pytest.LogCaptureFixture) -> None:
    """Publish fails with BusError while Redis is down; the subscriber resubscribes on its own."""

    async def body(server: RedisServer) -> None:
        bus, r = RedisBus(server.url, backoff_min_s=0.05, backoff_max_s=0.2), room()
        try:
            sub = bus.subscribe(r)
            pending = asyncio.create_task(take(sub, 3, timeout_s=20))
            await wait_subscribers(bus, r, 1)
            await bus.publish(r, "before")
            assert await bus.ping()

            server.stop()
            with pytest.raises(BusError):
                await bus.publish(r, "lost")
            assert not await bus.ping()
            await asyncio.sleep(0.5)  # let the subscriber notice and start retrying

            await asyncio.to_thread(server.start)
            # Published before the subscriber is back: no pub/sub delivery, replayed from history.
            await bus.publish(r, "during")
            await wait_subscribers(bus, r, 1)  # resubscribed to the new server
            await bus.publish(r, "after")
            assert await pending == ["before", "during", "after"]
            await sub.aclose()
        finally:
            await bus.close()

    with RedisServer() as server, caplog.at_level(logging.WARNING, "streamserver.bus.redis"):
        run(lambda: body(server))
    assert "resubscribing" in caplog.text


def test_redis_history_survives_restart_with_aof(tmp_path: Path) -> None:
    async def body(server: RedisServer) -> None:
        bus, r = RedisBus(server.url, history_len=5), room()
        try:
            sent = events("p", 7)
            for e in sent:
                await bus.publish(r, e)
            await asyncio.to_thread(server.stop)
            await asyncio.to_thread(server.start)
            assert await bus.history(r) == sent[-5:]
        finally:
            await bus.close()

    with RedisServer(persist_dir=tmp_path) as server:
        run(lambda: body(server))


def test_a_room_whose_record_cannot_be_written_is_not_kept() -> None:
    """A room the bus refused (Redis down, here a port nobody listens on) is not left in the
    process's registry: nobody could open its links, and it would count as a room for hours."""
    from streamserver.rooms.directory import RoomDirectory
    from streamserver.rooms.registry import RoomRegistry
    from tests.redis_server import free_port

    async def body() -> None:
        bus = RedisBus(f"redis://127.0.0.1:{free_port()}")
        registry = RoomRegistry(500)
        try:
            with pytest.raises(BusError):
                await RoomDirectory(registry, bus, 60, 60).create("7B", "en")
            assert registry.rooms == {}
        finally:
            await bus.close()

    run(body)
