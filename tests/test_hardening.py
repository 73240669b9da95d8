"""The probes of issue 12 fail: pacing, queue bounds, issued identities, per-address limits,
ICE candidates, closed rooms, the upgrade check, the secret, /metrics and the header timeout.
Real app (tests/live_app.py, the tiny.en engine), real Redis where a queue is Redis's."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import aiohttp
import numpy as np
import pytest
from aiortc import RTCPeerConnection

from streamserver import cli
from streamserver.audio.pacing import Pacer, TooFast
from streamserver.bus.memory import MemoryBus
from streamserver.bus.ordered import OrderedPublisher
from streamserver.config import Bounds
from streamserver.events import NoSpeechEvent, Utterance, now
from streamserver.loadsim.clients import Dashboard, token_of
from streamserver.queue.base import QueueFull
from streamserver.queue.memory_queue import MemoryQueue
from streamserver.queue.redis_queue import RedisQueue
from streamserver.transport.webrtc import use_host_addresses
from tests.live_app import ADMIN_TOKEN, live_app, ws_outcome
from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def live(tiny_engine):
    with live_app(tiny_engine, max_students=50) as app:
        yield app


def utterance(room: str, student: str, source: str = "") -> Utterance:
    t = now()
    return Utterance(uuid.uuid4().hex, room, student, "Ann", "en", np.zeros(1600, np.float32), t, t, source=source)


# --- pacing and queue bounds ------------------------------------------------------------------

def test_a_stream_may_not_outrun_real_time():
    clock = [0.0]
    refused = []
    pacer = Pacer(rate=1.5, burst_s=3.0, clock=lambda: clock[0], on_refused=lambda: refused.append(1))  # a 3 s burst here
    pacer.take(16000)  # the first second at once: a new stream's allowance
    with pytest.raises(TooFast, match="real time"):
        pacer.take(320)
    for _ in range(500):  # then 10 s of 20 ms frames at 1.4x real time
        clock[0] += 0.02 / 1.4
        pacer.take(320)
    clock[0] += 10  # a stall: what it held back may come at once, up to the 3 s burst
    pacer.take(48000)
    with pytest.raises(TooFast):
        pacer.take(320)
    assert len(refused) == 2


def test_memory_queue_bounds_each_student_room_and_the_whole():
    async def body() -> None:
        queue = MemoryQueue(OrderedPublisher(MemoryBus()), bounds=Bounds(total=5, per_room=3, per_student=2))
        await queue.submit(utterance("a", "s1"))
        await queue.submit(utterance("a", "s1"))
        with pytest.raises(QueueFull) as full:
            await queue.submit(utterance("a", "s1"))
        assert full.value.scope == "student"
        await queue.submit(utterance("a", "s2"))
        with pytest.raises(QueueFull) as full:
            await queue.submit(utterance("a", "s3"))
        assert full.value.scope == "room"
        await queue.submit(utterance("b", "s1"))
        await queue.submit(utterance("c", "s1"))
        with pytest.raises(QueueFull) as full:
            await queue.submit(utterance("d", "s1"))
        assert full.value.scope == "total"
        assert await queue.backlog() == {"a": 3, "b": 1, "c": 1}
        for entry_id, u in await queue.read(10, 100):  # completing frees their places
            await queue.complete(entry_id, u, NoSpeechEvent.of(u))
        assert await queue.backlog() == {} and await queue.depth() == 0
        await queue.submit(utterance("a", "s1"))

    asyncio.run(body())


async def _bounded_redis_queue(redis_url: str) -> tuple[RedisQueue, RedisQueue]:
    """An empty Redis queue bounded at 100 in all, 3 a room and 2 a student: a gateway's side and a worker's."""
    producer = RedisQueue(redis_url, bounds=Bounds(total=100, per_room=3, per_student=2))
    worker = RedisQueue(redis_url, "bounds-worker")
    await producer.redis.flushdb()
    await worker.ensure_group()
    return producer, worker


def test_redis_queue_bounds_are_counted_with_the_stream(redis_url):
    async def body() -> None:
        producer, worker = await _bounded_redis_queue(redis_url)
        await producer.submit(utterance("a", "s1"))
        await producer.submit(utterance("a", "s1"))
        with pytest.raises(QueueFull) as full:
            await producer.submit(utterance("a", "s1"))
        assert full.value.scope == "student"
        await producer.submit(utterance("a", "s2"))
        with pytest.raises(QueueFull) as full:
            await producer.submit(utterance("a", "s3"))
        assert full.value.scope == "room"
        assert await producer.backlog() == {"a": 3}
        entries = await worker.read(10, 100)
        for entry_id, u in entries:
            await worker.complete(entry_id, u, NoSpeechEvent.of(u))
            await worker.complete(entry_id, u, NoSpeechEvent.of(u))  # a second delivery counts nothing out
        assert await producer.backlog() == {} and await producer.depth() == 0
        await producer.submit(utterance("a", "s1"))
        await producer.close()
        await worker.close()

    asyncio.run(body())


async def _a_flooding_source_gives_way(queue, worker) -> None:  # noqa: ANN001 - either queue
    """Room "a" (bound 3) filled by students of one source: another source's utterance takes the
    place of the flooder's newest waiting one, never of one a worker holds; the flooder's next is
    refused; counts stay exact."""
    held = [utterance("a", "s1", "flood")]
    await queue.submit(held[0])
    [(held_id, _)] = await worker.read(1, 100)  # delivered: never displaced
    flood = [utterance("a", "s2", "flood"), utterance("a", "s3", "flood")]
    for u in flood:
        assert await queue.submit(u) is None
    ann = utterance("a", "ann", "10.0.0.2")
    displaced = await queue.submit(ann)
    assert (displaced.utterance_id, displaced.student_id) == (flood[1].utterance_id, "s3")
    with pytest.raises(QueueFull) as full:  # the flooder holds 2, Ann 1: the flooder is refused
        await queue.submit(utterance("a", "s4", "flood"))
    assert full.value.scope == "room"
    assert (await queue.submit(utterance("a", "ann", "10.0.0.2"))).utterance_id == flood[0].utterance_id
    with pytest.raises(QueueFull):  # now the flooder holds 1 (its utterance in recognition), Ann 2
        await queue.submit(utterance("a", "ann", "10.0.0.2"))
    assert await queue.backlog() == {"a": 3}
    entries = [(held_id, held[0])] + await worker.read(10, 100)
    assert sorted(u.student_id for _, u in entries) == ["ann", "ann", "s1"]
    for entry_id, u in entries:
        await worker.complete(entry_id, u, NoSpeechEvent.of(u))
    assert await queue.backlog() == {} and await queue.depth() == 0
    for student in ("s5", "s6", "s7"):  # the room's places all came back
        assert await queue.submit(utterance("a", student, "flood")) is None


def test_memory_queue_a_flooding_source_gives_way_at_the_rooms_bound():
    async def body() -> None:
        queue = MemoryQueue(OrderedPublisher(MemoryBus()), bounds=Bounds(total=100, per_room=3, per_student=2))
        await _a_flooding_source_gives_way(queue, queue)

    asyncio.run(body())


def test_redis_queue_a_flooding_source_gives_way_at_the_rooms_bound(redis_url):
    async def body() -> None:
        producer, worker = await _bounded_redis_queue(redis_url)
        await _a_flooding_source_gives_way(producer, worker)
        await producer.close()
        await worker.close()

    asyncio.run(body())


# --- identity and per-address limits ------------------------------------------------------------

async def _join(live, token: str, **identity: str) -> tuple[aiohttp.ClientWebSocketResponse, dict]:
    params = {"token": token, "name": "Ann", **identity}
    ws = await live.session.ws_connect(f"{live.ws_url}/ws/ingest", params=params)
    return ws, await ws.receive_json(timeout=10)


def test_a_guessed_student_id_gets_a_new_identity(live):
    async def body() -> None:
        room = await live.create_room("hijack")
        token = token_of(room["student_url"])
        ann, ready = await _join(live, token)
        mallory, taken = await _join(live, token, student_id=ready["student_id"])
        assert taken["student_id"] != ready["student_id"]
        forged, guess = await _join(live, token, student_id=ready["student_id"], resume=ready["resume"][:-2] + "AA")
        assert guess["student_id"] not in (ready["student_id"], taken["student_id"])
        assert (await ws_outcome(ann, timeout=1.0))[1] is None  # Ann was not taken over
        again, back = await _join(live, token, student_id=ready["student_id"], resume=ready["resume"])
        assert back["student_id"] == ready["student_id"]  # the real reconnect proves it
        assert (await ws_outcome(ann))[1] == 4001
        for ws in (mallory, forged, again):
            await ws.close()

    live.run(body())


async def _refused(live, token: str) -> tuple[int, str]:
    try:
        ws, _ = await _join(live, token)
    except aiohttp.WSServerHandshakeError as error:
        return error.status, error.message
    await ws.close()
    raise AssertionError("got in")


async def _room_with(live, **limits: int) -> dict:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with live.session.post(f"{live.url}/api/rooms", json={"name": "limited", **limits}, headers=headers) as r:
        assert r.status == 201, await r.text()
        return await r.json()


def test_a_link_limits_seats_and_joins_per_address(live):
    async def body() -> None:
        room = await _room_with(live, seats_per_address=2)
        token = token_of(room["student_url"])
        first, second = (await _join(live, token))[0], (await _join(live, token))[0]
        assert (await _refused(live, token))[0] == 429  # a third seat from 127.0.0.1
        body = {"token": token, "sdp": "v=0\r\n", "type": "offer", "student_name": "Rtc"}
        async with live.session.post(f"{live.url}/api/rooms/{room['room_id']}/offer", json=body) as r:
            assert r.status == 429 and "address" in (await r.json())["error"]
        await first.close()
        await second.close()

        room = await _room_with(live, joins_per_minute=3)
        token = token_of(room["student_url"])
        for _ in range(3):
            ws, _ = await _join(live, token)
            await ws.close()
        status, reason = await _refused(live, token)
        assert status == 429  # the fourth join of the minute, though no seat is held

    live.run(body())


def test_the_limits_are_checked_when_a_room_is_created(live):
    async def body() -> None:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        for bad in ({"seats_per_address": 0}, {"joins_per_minute": "5"}, {"seats_per_address": 1.5}):
            async with live.session.post(f"{live.url}/api/rooms", json={"name": "x", **bad}, headers=headers) as r:
                assert r.status == 400, bad

    live.run(body())


# --- ICE candidates ------------------------------------------------------------------------------

async def _audio_offer() -> tuple[RTCPeerConnection, str]:
    use_host_addresses(["127.0.0.1"])
    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="sendonly")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


def _with_candidates(sdp: str, candidates: list[str]) -> str:
    lines = [line for line in sdp.splitlines() if not line.startswith("a=candidate:")]
    at = next(i for i, line in enumerate(lines) if line.startswith("m=audio")) + 1
    return "\r\n".join(lines[:at] + candidates + lines[at:]) + "\r\n"


def _stun_packets_to(port_socket: socket.socket, seconds: float) -> int:
    port_socket.settimeout(0.2)
    packets, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            port_socket.recvfrom(2048)
            packets += 1
        except TimeoutError:
            pass
    return packets


@pytest.mark.parametrize("allow, contacted", [(["127.0.0.1/32"], False), ([], True)])
def test_an_offer_names_few_candidates_and_only_allowed_ones_are_contacted(tiny_engine, allow, contacted):
    """A real aiortc offer whose candidates name a socket on 127.0.0.2: with `--ice-allow
    127.0.0.1/32` it receives no STUN packet; with loopback allowed (the server gathers on it)
    it does, so the probe would see them. Fifty candidates are refused outright."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.2", 0))
    port = probe.getsockname()[1]
    with live_app(tiny_engine, ice_allow=allow) as live:
        async def offer(sdp: str) -> tuple[int, dict]:
            room = await live.create_room("ice")
            body = {"token": token_of(room["student_url"]), "sdp": sdp, "type": "offer", "student_name": "Ice"}
            async with live.session.post(f"{live.url}/api/rooms/{room['room_id']}/offer", json=body) as r:
                return r.status, await r.json()

        async def body() -> int:
            pc, sdp = await _audio_offer()
            many = [f"a=candidate:{i} 1 udp 2130706431 127.0.0.2 {port + i} typ host" for i in range(50)]
            status, answer = await offer(_with_candidates(sdp, many))
            assert status == 400 and "at most 10" in answer["error"]
            few = [f"a=candidate:{i} 1 udp 2130706431 127.0.0.2 {port} typ host" for i in range(3)]
            status, _ = await offer(_with_candidates(sdp, few))
            assert status == 200
            packets = await asyncio.to_thread(_stun_packets_to, probe, 3.0)
            await pc.close()
            return packets

        packets = live.run(body())
    probe.close()
    assert (packets > 0) == contacted, packets


# --- closing a room, the upgrade check ------------------------------------------------------------

def test_a_closed_room_ends_its_sessions_and_its_links(live):
    async def body() -> None:
        room = await live.create_room("to close")
        student, teacher = token_of(room["student_url"]), token_of(room["teacher_url"])
        ws, _ = await _join(live, student)
        dashboard = await Dashboard().open(live.session, live.url, room)
        url = f"{live.url}/api/rooms/{room['room_id']}"
        async with live.session.delete(url, headers={"Authorization": f"Bearer {student}"}) as r:
            assert r.status == 403  # a student cannot close it
        async with live.session.delete(url, headers={"Authorization": f"Bearer {teacher}"}) as r:
            assert r.status == 200 and (await r.json())["closed"] is True
        messages, code = await ws_outcome(ws)
        assert code == 4003 and "closed" in messages[-1]["error"]
        await dashboard.closed()
        assert dashboard.ws.close_code == 4003 and "room_closed" in [e["type"] for e in dashboard.events]
        # Every route answers 403 to the room's links from now on.
        assert (await _refused(live, student))[0] == 403
        body = {"token": student, "sdp": "v=0\r\n", "type": "offer", "student_name": "Late"}
        async with live.session.post(f"{url}/offer", json=body) as r:
            assert r.status == 403
        async with live.session.get(f"{url}/feed", params={"token": teacher}) as r:
            assert r.status == 403
        async with live.session.delete(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
            assert r.status == 403
        async with live.session.delete(f"{live.url}/api/rooms/nosuchroom", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
            assert r.status == 404

    live.run(body())


def test_only_the_teacher_marks_a_question_group_answered_and_every_dashboard_hears_it(live):
    async def body() -> None:
        room = await live.create_room("hall")
        student, teacher = token_of(room["student_url"]), token_of(room["teacher_url"])
        dashboards = [await Dashboard().open(live.session, live.url, room) for _ in range(2)]  # the teacher's, a TA's
        url = f"{live.url}/api/rooms/{room['room_id']}/question_groups/w1.ab12cd:3/answered"
        async with live.session.post(url) as r:
            assert r.status == 401
        async with live.session.post(url, headers={"Authorization": f"Bearer {student}"}) as r:
            assert r.status == 403
        bad = f"{live.url}/api/rooms/{room['room_id']}/question_groups/{'x' * 201}/answered"
        async with live.session.post(bad, headers={"Authorization": f"Bearer {teacher}"}) as r:
            assert r.status == 400
        async with live.session.post(url, headers={"Authorization": f"Bearer {teacher}"}) as r:
            assert r.status == 200 and (await r.json())["answered"] is True
        for _ in range(100):
            if all(any(e["type"] == "question_group_answered" for e in d.events) for d in dashboards):
                break
            await asyncio.sleep(0.05)
        for dashboard in dashboards:
            (answered,) = [e for e in dashboard.events if e["type"] == "question_group_answered"]
            assert answered["group_id"] == "w1.ab12cd:3" and answered["room_id"] == room["room_id"]
        late = await Dashboard().open(live.session, live.url, room)  # one that joins later: from the history
        for _ in range(100):
            if late.history:
                break
            await asyncio.sleep(0.05)
        assert [e["group_id"] for e in late.history if e["type"] == "question_group_answered"] == ["w1.ab12cd:3"]

    live.run(body())


def test_a_plain_get_to_the_ingest_seats_nobody(live):
    async def body() -> None:
        room = await live.create_room("no upgrade")
        dashboard = await Dashboard().open(live.session, live.url, room)
        async with live.session.get(f"{live.url}/ws/ingest", params={"token": token_of(room["student_url"]), "name": "Gus"}) as r:
            assert r.status == 400
        await asyncio.sleep(0.3)
        assert not live.classroom.rooms.get(room["room_id"]).students
        assert not [e for e in dashboard.events if e["type"] == "student_joined"]
        await dashboard.close()

    live.run(body())


def test_metrics_need_the_admin_token(live):
    async def body() -> None:
        async with live.session.get(f"{live.url}/metrics") as r:
            assert r.status == 401
        async with live.session.get(f"{live.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
            assert r.status == 200 and "streamserver_paced_refusals_total" in await r.text()

    live.run(body())


# --- the process: the secret, the header timeout ----------------------------------------------------

def test_a_gateway_or_redis_serve_needs_the_secret(monkeypatch, capsys):
    monkeypatch.delenv("STREAMSERVER_SECRET", raising=False)
    assert cli.main(["gateway", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert cli.main(["serve", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert capsys.readouterr().err.count("STREAMSERVER_SECRET") == 2


def test_a_half_sent_request_is_closed_after_the_header_timeout():
    with ServerProcess("--header-timeout", "2") as server:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            s.settimeout(10)
            started = time.monotonic()
            assert s.recv(100) == b""  # closed by the server
            assert time.monotonic() - started < 4


def test_a_lagging_event_loop_says_it_is_overloaded():
    """Late on most ticks of the window: busy (and a warning); one hiccup: not. The ticks are
    measured on the running loop: a blocked loop shows in them."""
    from streamserver.loop_lag import WINDOW, LoopLag

    lag = LoopLag()
    for _ in range(WINDOW - 1):
        lag.record(0.0)
    lag.record(1.0)
    assert lag.overloaded() is None
    for _ in range(WINDOW // 2 + 1):
        lag.record(0.3)
    assert "overloaded" in (lag.overloaded() or "")

    measured = LoopLag()

    async def body() -> None:
        task = asyncio.create_task(measured.run())
        await asyncio.sleep(0.05)
        time.sleep(0.4)  # the loop is blocked
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(body())
    assert max(measured.recent) > 0.25
