"""The per-room student limit across gateways: two in-process gateways (the `streamserver gateway`
app) on one real redis-server, students over the WebSocket ingest and the WebRTC offer route.

A gateway turns students away as busy while no ASR worker is alive, so a stand-in worker beats
its heartbeat in Redis; no engine is needed, nobody speaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import AsyncIterator

import aiohttp
from aiohttp.test_utils import TestServer

from streamserver.api.app import create_app
from streamserver.bus.ordered import OrderedPublisher
from streamserver.bus.redis import RedisBus
from streamserver.classroom import Classroom
from streamserver.config import Settings
from streamserver.metrics import Metrics
from streamserver.server import gateway_app
from streamserver.client import feed_url
from streamserver.loadsim.clients import create_room, token_of
from streamserver.bus.keys import WORKERS, alive_key
from streamserver.queue.redis_queue import RedisQueue
from streamserver.queue.sink import UtteranceSink
from streamserver.rooms import tokens
from tests.redis_server import RedisServer
from tests.server_process import ADMIN_TOKEN

SECRET = "seat-test-secret"  # shared by the gateways: a token signed by one is good on the other
NOT_AN_AUDIO_OFFER = "v=0\r\n"  # refused (400) only once the student has been seated


def settings(redis_url: str, **overrides) -> Settings:
    base = dict(redis_url=redis_url, secret=SECRET, admin_token=ADMIN_TOKEN, ice_hosts=["127.0.0.1"],
                max_students=2, leave_grace_s=0.1)
    return Settings(**{**base, **overrides})


def run(body) -> None:
    asyncio.run(asyncio.wait_for(body(), 30))


@contextlib.asynccontextmanager
async def live_worker(redis_url: str, stats: dict | None = None) -> AsyncIterator[None]:
    """A worker's heartbeat (`stats`: what it says of itself; by default 100 utterances/s), so
    that the gateways take students."""
    queue = RedisQueue(redis_url, worker=f"seat-test-{uuid.uuid4().hex[:8]}")
    stats = stats or {"utt_per_s": 100.0}

    async def beat() -> None:
        while True:
            await queue.heartbeat(stats)
            await asyncio.sleep(0.2)

    await queue.heartbeat(stats)
    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        await queue.redis.hdel(WORKERS, queue.worker)
        await queue.redis.delete(alive_key(queue.worker))
        await queue.close()


@contextlib.asynccontextmanager
async def serving(*classrooms_and_apps) -> AsyncIterator[list[tuple[str, Classroom]]]:
    servers = []
    try:
        for app, classroom in classrooms_and_apps:
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            servers.append((server, classroom))
        yield [(f"http://127.0.0.1:{server.port}", classroom) for server, classroom in servers]
    finally:
        for server, _ in servers:
            await server.close()


def gateways(redis_url: str, n: int = 2, **overrides):
    return serving(*(gateway_app(settings(redis_url, **overrides)) for _ in range(n)))


# The server issues identities: a test's student label -> the id and resume secret it was given,
# presented again on every later join of that label (a reconnect of the same student).
IDENTITIES: dict[str, dict[str, str]] = {}


async def join(s: aiohttp.ClientSession, url: str, token: str, student_id: str) -> aiohttp.ClientWebSocketResponse:
    """A WebSocket student, once the gateway said "ready"."""
    params = {"token": token, "name": student_id[:3], **IDENTITIES.get(student_id, {})}
    ws = await s.ws_connect(url.replace("http", "ws") + "/ws/ingest", params=params)
    ready = await ws.receive_json(timeout=5)
    assert ready["type"] == "ready"
    IDENTITIES[student_id] = {"student_id": ready["student_id"], "resume": ready["resume"]}
    return ws


async def join_status(s: aiohttp.ClientSession, url: str, token: str, student_id: str) -> int:
    """200 when a WebSocket student gets in (its socket is closed again), else the HTTP status it
    is turned away with."""
    try:
        ws = await join(s, url, token, student_id)
    except aiohttp.WSServerHandshakeError as error:
        return error.status
    await ws.close()
    return 200


async def refused(s: aiohttp.ClientSession, url: str, token: str, student_id: str) -> int:
    """The HTTP status a WebSocket student is turned away with (fails if it gets in)."""
    status = await join_status(s, url, token, student_id)
    assert status != 200, f"{student_id} got in"
    return status


async def join_when_free(s: aiohttp.ClientSession, url: str, token: str, student_id: str, within_s: float) -> aiohttp.ClientWebSocketResponse:
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await join(s, url, token, student_id)
        except aiohttp.WSServerHandshakeError as error:
            assert error.status == 429 and time.monotonic() < deadline, f"{student_id}: {error.status}"
            await asyncio.sleep(0.05)


async def offer(s: aiohttp.ClientSession, url: str, room: dict, student_id: str, sdp: str) -> tuple[int, dict]:
    body = {"token": token_of(room["student_url"]), "type": "offer", "sdp": sdp, "student_name": "Rtc",
            **IDENTITIES.get(student_id, {})}
    async with s.post(f"{url}/api/rooms/{room['room_id']}/offer", json=body) as r:
        return r.status, await r.json()


def test_room_limit_holds_across_gateways(redis_url):
    """max_students=2: one student through gateway A, one through B, and the room is full on
    both (WebSocket and WebRTC); a leaver's seat goes to the next, and a WebRTC offer that fails
    after its student was seated gives the seat back."""

    async def body() -> None:
        async with live_worker(redis_url), gateways(redis_url) as [(a, _), (b, _)], aiohttp.ClientSession() as s:
            room = await create_room(s, a, ADMIN_TOKEN, "two doors")
            token = token_of(room["student_url"])
            ann = await join(s, a, token, "ann-00000001")
            bob = await join(s, b, token, "bob-00000001")  # kept: a socket dropped here would close
            assert await refused(s, a, token, "cyd-00000001") == 429
            assert await refused(s, b, token, "cyd-00000001") == 429
            status, answer = await offer(s, b, room, "cyd-00000001", NOT_AN_AUDIO_OFFER)
            assert status == 429 and answer["error"] == "room is full (2 students)"
            await ann.close()  # A frees her seat after its grace period; B seats the next student
            cyd = await join_when_free(s, b, token, "cyd-00000001", within_s=3)
            assert await refused(s, a, token, "dee-00000001") == 429
            await cyd.close()
            for _ in range(60):  # until B has freed cyd's seat: then the bad offer reaches WebRTC
                status, answer = await offer(s, a, room, "dee-00000001", NOT_AN_AUDIO_OFFER)
                if status != 429:
                    break
                await asyncio.sleep(0.05)
            assert status == 400 and "no audio" in answer["error"]
            eve = await join(s, a, token, "eve-00000001")  # the failed offer's seat came back
            assert await refused(s, b, token, "fay-00000001") == 429
            await asyncio.gather(bob.close(), eve.close())

    run(body)


def test_seats_of_a_dead_gateway_expire_and_a_dashboard_hears_its_students_left(redis_url):
    """Renewed seats outlive their lease; a gateway that stops renewing (it died) frees its
    students' seats within one lease, without ever releasing them. It says nothing of them
    either: a dashboard open on another gateway is told that its two students left (not the two
    who came in through it meanwhile), within a lease and two looks at the seats (every third of
    a lease)."""
    lease = 1.0

    async def body() -> None:
        async with live_worker(redis_url), gateways(redis_url, seat_lease_s=lease) as [(a, dying), (b, _)], \
                aiohttp.ClientSession() as s:
            room = await create_room(s, a, ADMIN_TOKEN, "a gateway dies")
            token = token_of(room["student_url"])
            students = [await join(s, a, token, "ann-00000002"), await join(s, a, token, "bob-00000002")]
            feed = await s.ws_connect(feed_url(b, room["room_id"], token_of(room["teacher_url"])))
            assert (await feed.receive_json(timeout=5))["type"] == "history"
            assert len((await feed.receive_json(timeout=5))["students"]) == 2
            await asyncio.sleep(2.5 * lease)  # A renews them meanwhile
            assert await refused(s, b, token, "cyd-00000002") == 429
            assert dying.seats._task is not None
            dying.seats._task.cancel()  # A "dies": its students stay connected to it, unrenewed
            started = time.monotonic()
            students.append(await join_when_free(s, b, token, "cyd-00000002", within_s=lease + 1))
            assert time.monotonic() - started <= lease + 0.75
            students.append(await join_when_free(s, b, token, "dee-00000002", within_s=0.5))
            assert await refused(s, b, token, "eve-00000002") == 429
            left: list[tuple[str, float]] = []
            while len(left) < 2 and time.monotonic() - started < 3 * lease + 2:
                with contextlib.suppress(asyncio.TimeoutError):
                    if (event := await feed.receive_json(timeout=0.2))["type"] == "student_left":
                        left.append((event["student_name"], time.monotonic() - started))
            assert sorted(name for name, _ in left) == ["ann", "bob"], left
            assert max(at for _, at in left) <= lease + 2 * lease / 3 + 0.75, left
            await feed.close()
            await asyncio.gather(*(ws.close() for ws in students))

    run(body)


def test_reconnect_keeps_the_seat_in_a_full_room(redis_url):
    """A full room: a student reconnecting with her student_id gets back in, through the other
    gateway or the same one, and the room stays full; her old gateway letting her go does not
    free the seat the new one holds."""

    async def body() -> None:
        async with live_worker(redis_url), gateways(redis_url) as [(a, _), (b, _)], aiohttp.ClientSession() as s:
            room = await create_room(s, a, ADMIN_TOKEN, "reconnects")
            token = token_of(room["student_url"])
            ann_on_a = await join(s, a, token, "ann-00000003")
            bob = await join(s, b, token, "bob-00000003")
            ann_on_b = await join(s, b, token, "ann-00000003")  # through the other gateway
            assert await refused(s, a, token, "cyd-00000003") == 429
            await ann_on_a.close()
            await asyncio.sleep(0.5)  # A's grace period is over: A has let her go
            assert await refused(s, b, token, "cyd-00000003") == 429
            ann_again = await join(s, b, token, "ann-00000003")  # through the same gateway: replaces her stream
            await ann_on_b.send_bytes(bytes(640))
            assert "replaced" in (await ann_on_b.receive_json(timeout=5))["error"]
            status, _ = await offer(s, a, room, "bob-00000003", NOT_AN_AUDIO_OFFER)  # bob via WebRTC: his seat, a bad offer
            assert status == 400
            assert await refused(s, a, token, "cyd-00000003") == 429
            await asyncio.gather(bob.close(), ann_again.close(), ann_on_b.close())

    run(body)


def test_bus_failure_while_seating_is_503_and_passes(redis_url):
    """The bus's Redis is down when a student comes: a 503 naming the seat (WebSocket and
    WebRTC), not a crash; once it is back, the same student gets in."""

    async def body(bus_redis: RedisServer) -> None:
        config = settings(redis_url)
        bus = RedisBus(bus_redis.url)
        publisher = OrderedPublisher(bus)
        metrics = Metrics()
        classroom = Classroom(config, bus, UtteranceSink(RedisQueue(redis_url), publisher, metrics, 5.0), publisher, metrics)
        room = classroom.rooms.create("local", "en")  # known here: finding it needs no bus
        student = {"student_url": "?token=" + tokens.issue(SECRET, room.room_id, "student", 600), "room_id": room.room_id}
        token = token_of(student["student_url"])
        async with live_worker(redis_url), serving((create_app(classroom), classroom)) as [(url, _)], \
                aiohttp.ClientSession() as s:
            await asyncio.to_thread(bus_redis.stop)
            assert await refused(s, url, token, "ann-00000004") == 503
            status, answer = await offer(s, url, student, "ann-00000004", NOT_AN_AUDIO_OFFER)
            assert status == 503 and "seat" in answer["error"], answer
            await asyncio.to_thread(bus_redis.start)
            await (await join(s, url, token, "ann-00000004")).close()

    with RedisServer() as bus_redis:
        run(lambda: body(bus_redis))


def test_the_room_keeps_its_creators_limit_on_every_gateway(redis_url):
    """A room created on a gateway with --max-students 2 is full at 2 on a gateway started with
    10 as well: the limit travels with the room's record."""

    async def body() -> None:
        apps = (gateway_app(settings(redis_url, max_students=2)), gateway_app(settings(redis_url, max_students=10)))
        async with live_worker(redis_url), serving(*apps) as [(a, _), (b, _)], aiohttp.ClientSession() as s:
            room = await create_room(s, a, ADMIN_TOKEN, "small room")
            token = token_of(room["student_url"])
            ann = await join(s, b, token, "ann-00000002")
            bob = await join(s, b, token, "bob-00000002")
            assert await refused(s, b, token, "cyd-00000002") == 429
            await asyncio.gather(ann.close(), bob.close())

    run(body)


async def roster_of(s: aiohttp.ClientSession, url: str, room: dict) -> dict[str, str]:
    """The roster a dashboard opening its feed on gateway `url` gets: student id -> name."""
    async with s.ws_connect(feed_url(url, room["room_id"], token_of(room["teacher_url"]))) as feed:
        assert (await feed.receive_json(timeout=5))["type"] == "history"
        roster = await feed.receive_json(timeout=5)
    assert roster["type"] == "roster"
    return {student["student_id"]: student["student_name"] for student in roster["students"]}


def test_a_dashboard_on_any_gateway_lists_the_whole_room(redis_url):
    """A dashboard's roster is every student seated in the room, through whichever gateway (with
    several gateway processes a teacher's feed lands on any one of them), by name; a student who
    left through another gateway is gone from it."""

    async def body() -> None:
        async with live_worker(redis_url), gateways(redis_url, max_students=10) as [(a, _), (b, _)], aiohttp.ClientSession() as s:
            room = await create_room(s, a, ADMIN_TOKEN, "one room, two doors")
            token = token_of(room["student_url"])
            ann = await join(s, a, token, "ann-0000000a")
            bob = await join(s, b, token, "bob-0000000a")
            ids = {label: IDENTITIES[label]["student_id"] for label in ("ann-0000000a", "bob-0000000a")}
            everyone = {ids["ann-0000000a"]: "ann", ids["bob-0000000a"]: "bob"}
            assert await roster_of(s, a, room) == everyone
            assert await roster_of(s, b, room) == everyone
            await bob.close()  # B lets him go after its grace period
            for _ in range(60):
                if ids["bob-0000000a"] not in (roster := await roster_of(s, a, room)):
                    break
                await asyncio.sleep(0.05)
            assert roster == {ids["ann-0000000a"]: "ann"}
            await ann.close()

    run(body)


def test_presence_tells_a_dashboard_what_a_quiet_gateway_did_not():
    """rooms/presence.py over a feed's looks at the seats: a student whose seat is gone two looks
    in a row is announced as left, one who left by the room's own event or joined while a look
    was on its way is not, and one announced as left whose seat came back (their gateway renewed
    it after an outage) is announced as joined."""
    from streamserver.rooms.presence import JOINED, LEFT, Presence

    presence = Presence()
    presence.told([{"student_id": s, "student_name": s.upper()} for s in ("ann", "bob", "cyd")])

    def look(seated: set[str], joined: str | None = None) -> list[tuple[str, str, str]]:
        presence.look_starts()
        if joined:  # the room's own student_joined, while the look is on its way
            presence.noted(JOINED, joined, joined.upper())
        return presence.looked(seated, here=set())

    assert look({"ann"}) == []  # bob and cyd missing once: a release may be just ahead of its student_left
    presence.noted(LEFT, "cyd", "CYD")  # ... as cyd's was
    assert look({"ann"}, joined="dee") == [(LEFT, "bob", "BOB")]  # dee joined after the seats were read
    assert look({"ann", "dee"}) == [] and look({"ann", "dee"}) == []
    assert look({"ann", "dee", "bob"}) == [(JOINED, "bob", "BOB")]  # his gateway renewed his seat
    assert presence.present == {"ann": "ANN", "bob": "BOB", "dee": "DEE"}


def test_a_look_reads_who_is_seated_only_when_the_count_says_something_is_amiss():
    """Presence.needs_seats: a live seats' count that is where the last look that read the seats
    left it, against the students the dashboard was told are here, skips reading who they are,
    except every FULL_LOOK_EVERY-th look; a count short or long, or a student missing at the last
    look, reads them; a difference that lasts (a seat whose student_joined never came) does not."""
    from streamserver.rooms.presence import FULL_LOOK_EVERY, Presence

    presence = Presence()
    presence.told([{"student_id": s, "student_name": ""} for s in ("ann", "bob", "cyd")])
    assert presence.needs_seats(3)  # no look has read the seats yet

    def look(seated: set[str]) -> list[tuple[str, str, str]]:
        presence.look_starts()
        return presence.looked(seated, here=set())

    assert look({"ann", "bob", "cyd"}) == []
    reads = [presence.needs_seats(3) for _ in range(2 * FULL_LOOK_EVERY)]
    assert reads == ([False] * (FULL_LOOK_EVERY - 1) + [True]) * 2
    assert presence.needs_seats(2) and presence.needs_seats(4)  # a quiet gateway's student; a seat back
    assert look({"ann", "bob"}) == []  # cyd missing once
    assert presence.needs_seats(2)  # ... so the next look reads the seats whatever the count
    assert look({"ann", "bob"}) == [("student_left", "cyd", "")]
    assert not presence.needs_seats(2)
    assert look({"ann", "bob", "eve"}) == []  # eve's seat, whose student_joined never came
    assert not presence.needs_seats(3) and presence.needs_seats(2)


def test_a_room_closed_on_one_gateway_ends_its_students_on_the_other(redis_url):
    """DELETE on gateway A: a student seated through B is sent away within the rooms' watch
    period, and B answers the room's links 403 from then on."""

    async def body() -> None:
        async with live_worker(redis_url), gateways(redis_url) as [(a, _), (b, _)], aiohttp.ClientSession() as s:
            room = await create_room(s, a, ADMIN_TOKEN, "closed on A")
            token = token_of(room["student_url"])
            ann = await join(s, b, token, "ann-00000009")
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with s.delete(f"{a}/api/rooms/{room['room_id']}", headers=headers) as r:
                assert r.status == 200
            started = time.monotonic()
            message = await ann.receive_json(timeout=5)
            assert "closed" in message["error"] and time.monotonic() - started < 4
            await ann.receive(timeout=5)
            assert ann.close_code == 4003
            assert await refused(s, b, token, "bob-00000009") == 403

    run(body)


def test_a_class_ending_at_once_releases_every_seat_within_redis_client_limit():
    """600 students of one gateway leave together, against a Redis that takes 64 clients (as a
    fleet of gateways fills Redis's 10,000): every seat is released now, none is left to expire
    with its lease."""
    import redis.asyncio as aioredis

    from streamserver.rooms.registry import RoomRegistry
    from streamserver.rooms.seats import SeatKeeper

    server = RedisServer().start()

    async def body() -> None:
        admin = aioredis.Redis.from_url(server.url)
        bus = RedisBus(server.url)
        try:
            await admin.config_set("maxclients", 64)
            rooms = RoomRegistry(1000)
            keeper = SeatKeeper(bus, rooms, lease_s=30)
            room = rooms.create("lecture", "en", max_students=1000)
            students = [f"student-{i:03d}" for i in range(600)]
            for student in students:
                await keeper.take(room, student)
            seats = bus.keys.seats(room.room_id)[0]
            assert await admin.zcard(seats) == 600
            await asyncio.gather(*(keeper.free(room.room_id, student) for student in students))
            assert await admin.zcard(seats) == 0
        finally:
            await bus.close()
            await admin.aclose()

    try:
        run(body)
    finally:
        server.stop()
