"""The probes of issue 33 fail: one holder of a student link cannot take a room's seats (per-student
links, idle seats freed), the teacher's feed keeps its message limit and closes on a protocol
violation, and offers are limited per address (names: tests/test_hostile_input.py). Real app (tests/live_app.py,
the tiny.en engine), real sockets; the raw WebSocket frames are written byte for byte."""

from __future__ import annotations

import asyncio
import base64
import os
import struct
import time
from pathlib import Path

import aiohttp
import pytest

from streamserver.api.feed_socket import FEED_MESSAGE_LIMIT_BYTES
from streamserver.config import Settings
from streamserver.loadsim.clients import token_of
from tests.live_app import ADMIN_TOKEN, live_app, ws_outcome


@pytest.fixture(scope="module")
def live(tiny_engine):
    with live_app(tiny_engine, max_students=1000) as app:
        yield app


# --- the teacher's feed: its message limit, protocol violations -----------------------------------

def _frame(opcode: int, payload: bytes, fin: bool = True, mask: bool = True) -> bytes:
    """One WebSocket frame as a client writes it (RFC 6455 5.2), or breaks it (mask=False)."""
    head = bytes([(0x80 if fin else 0) | opcode])
    size = len(payload)
    mask_bit = 0x80 if mask else 0
    if size < 126:
        head += bytes([mask_bit | size])
    elif size < 1 << 16:
        head += bytes([mask_bit | 126]) + struct.pack("!H", size)
    else:
        head += bytes([mask_bit | 127]) + struct.pack("!Q", size)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """A server's frame (unmasked): its opcode and payload."""
    first, second = await reader.readexactly(2)
    size = second & 0x7F
    if size == 126:
        size = struct.unpack("!H", await reader.readexactly(2))[0]
    elif size == 127:
        size = struct.unpack("!Q", await reader.readexactly(8))[0]
    return first & 0x0F, await reader.readexactly(size)


async def _feed_close(live, room: dict, frames: list[bytes], timeout: float = 10) -> int | None:
    """Opens the room's feed over a raw socket, reads its history and roster, writes `frames`
    and returns the close code the server sends (None: the socket ended without a close frame)."""
    reader, writer = await asyncio.open_connection(live.server.host, live.server.port)
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        path = f"/api/rooms/{room['room_id']}/feed?token={token_of(room['teacher_url'])}"
        writer.write(f"GET {path} HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        assert head.startswith(b"HTTP/1.1 101"), head
        for _ in range(2):  # history, roster
            opcode, _ = await asyncio.wait_for(_read_frame(reader), timeout)
            assert opcode == 0x1
        for frame in frames:
            writer.write(frame)
        await writer.drain()
        while True:
            try:
                opcode, payload = await asyncio.wait_for(_read_frame(reader), timeout)
            except asyncio.IncompleteReadError:
                return None
            if opcode == 0x8:
                return struct.unpack("!H", payload[:2])[0]
    finally:
        writer.close()


@pytest.mark.parametrize("frames, code", [
    pytest.param([_frame(0x1, b"x" * (FEED_MESSAGE_LIMIT_BYTES + 1))], 1009, id="over-the-limit"),
    pytest.param([_frame(0x2, b"ab", fin=False), _frame(0x2, b"cd")], 1002, id="interleaved-fragments"),
    pytest.param([_frame(0x1, b"hello", mask=False)], 1002, id="unmasked"),
    pytest.param([_frame(0x0, b"orphan")], 1002, id="continuation-without-start"),
    pytest.param([_frame(0x9, b"p" * 126)], 1002, id="control-frame-over-125"),
    pytest.param([bytes([0x83, 0x80]) + os.urandom(4)], 1002, id="reserved-opcode"),
])
def test_the_feed_keeps_its_message_limit_and_closes_on_a_protocol_violation(live, frames, code):
    room = live.run(live.create_room("feed frames"))
    assert live.run(_feed_close(live, room, frames)) == code


def test_a_message_at_the_feed_limit_is_read_and_the_feed_stays_open(live):
    room = live.run(live.create_room("feed at the limit"))
    with pytest.raises(asyncio.TimeoutError):  # no close comes: the feed is open
        live.run(_feed_close(live, room, [_frame(0x1, b"x" * FEED_MESSAGE_LIMIT_BYTES)], timeout=1.5))


# --- per-student links: one link, one seat --------------------------------------------------------

async def _create(live, **body: object) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with live.session.post(f"{live.url}/api/rooms", json={"name": "links", **body}, headers=headers) as r:
        return r.status, await r.json()


async def _ingest(session: aiohttp.ClientSession, live, token: str, name: str) -> tuple[aiohttp.ClientWebSocketResponse, dict]:
    ws = await session.ws_connect(f"{live.ws_url}/ws/ingest", params={"token": token, "name": name})
    return ws, await ws.receive_json(timeout=10)


async def _refused(session: aiohttp.ClientSession, live, token: str) -> tuple[int, str]:
    try:
        ws, _ = await _ingest(session, live, token, "Late")
    except aiohttp.WSServerHandshakeError as error:
        return error.status, error.message
    await ws.close()
    raise AssertionError("got in")


def test_a_per_student_link_seats_one_student_whatever_its_holder_does(live):
    """A room of 3 seats with 3 per-student links: the holder of the first opens 10 joins at once
    under 10 names, 5 offers at once and reconnects; it holds one seat (one stream open, the
    others closed 4001), the other two links still get in, and a fourth student is refused."""

    async def body() -> None:
        status, room = await _create(live, max_students=3, student_links=3)
        assert status == 201 and "student_url" not in room and len(room["student_links"]) == 3
        mine, *others = room["student_links"]
        token = token_of(mine["student_url"])
        joins = await asyncio.gather(*(_ingest(live.session, live, token, f"Name{i}") for i in range(10)))
        assert {ready["student_id"] for _, ready in joins} == {mine["student_id"]}
        outcomes = await asyncio.gather(*(ws_outcome(ws, timeout=2) for ws, _ in joins))
        assert sorted(code or 0 for _, code in outcomes) == [0] + [4001] * 9, outcomes  # one stays open (0: no close)
        survivor = next(ws for (ws, _), (_, code) in zip(joins, outcomes) if code is None)

        offer = {"token": token, "sdp": "v=0\r\n", "type": "offer", "student_name": "Rtc"}
        url = f"{live.url}/api/rooms/{room['room_id']}/offer"

        async def post() -> int:
            async with live.session.post(url, json=offer) as r:
                return r.status

        assert await asyncio.gather(*(post() for _ in range(5))) == [400] * 5  # seated as itself, then a bad offer

        seated = [await _ingest(live.session, live, token_of(link["student_url"]), "Real") for link in others]
        assert [ready["student_id"] for _, ready in seated] == [link["student_id"] for link in others]
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with live.session.post(f"{url.rsplit('/', 1)[0]}/student_links", json={"student_links": 1}, headers=headers) as r:
            assert r.status == 201
            fourth = (await r.json())["student_links"][0]
        status, _ = await _refused(live.session, live, token_of(fourth["student_url"]))
        assert status == 429

        again, ready = await _ingest(live.session, live, token, "Yet another name")  # a reconnect: its own seat
        assert ready["student_id"] == mine["student_id"]
        assert (await ws_outcome(survivor, timeout=5))[1] == 4001
        assert len(live.classroom.rooms.get(room["room_id"]).students) == 3
        for ws in (again, *(ws for ws, _ in seated)):
            await ws.close()

    live.run(body())


def test_a_platform_identity_keeps_its_name_and_bad_requests_are_400(live):
    async def body() -> None:
        status, room = await _create(live, students=[{"id": "lms:17", "name": "Ann\u200b"}, {"id": "lms:18"}])
        assert status == 201 and [(s["student_id"], s.get("name")) for s in room["student_links"]] == \
            [("lms:17", "Ann"), ("lms:18", None)]
        ann, ready = await _ingest(live.session, live, token_of(room["student_links"][0]["student_url"]), "Mallory")
        bob, _ = await _ingest(live.session, live, token_of(room["student_links"][1]["student_url"]), "Bob")
        students = live.classroom.rooms.get(room["room_id"]).students
        assert ready["student_id"] == "lms:17" and students["lms:17"].name == "Ann" and students["lms:18"].name == "Bob"
        await ann.close()
        await bob.close()
        for bad in ({"student_links": 0}, {"student_links": "3"}, {"students": [{"id": "a b"}]}, {"students": []},
                    {"students": [{"id": "x"}, {"id": "x"}]}, {"students": [{"id": "x", "name": "\u200b"}]},
                    {"student_links": 2, "students": [{"id": "x"}]}):
            assert (await _create(live, **bad))[0] == 400, bad
        async with live.session.post(f"{live.url}/api/rooms/{room['room_id']}/student_links", json={"student_links": 1},
                                     headers={"Authorization": f"Bearer {token_of(room['teacher_url'])}"}) as r:
            assert r.status == 401  # minting is the platform's (the admin token's), not the teacher's

    live.run(body())


# --- idle seats ------------------------------------------------------------------------------------

def test_idle_sockets_of_the_shared_link_cannot_keep_real_students_out(tiny_engine):
    """The probe, small: one address holds every seat of a room with idle sockets. A real student
    (another address) is refused while they hold them, and seated once their streams are ended
    for sending no audio; a silent student sending silence keeps its seat. The idle time is cut
    to 1.5 s here; the default is the figure docs/SECURITY.md states."""
    idle_s = 1.5
    with live_app(tiny_engine, idle_seat_s=idle_s, leave_grace_s=0.2) as live:
        async def body() -> None:
            status, room = await _create(live, max_students=3)
            token = token_of(room["student_url"])
            holder = [(await _ingest(live.session, live, token, f"Idle{i}"))[0] for i in range(3)]
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as school:
                status, _ = await _refused(school, live, token)
                assert status == 429
                outcomes = await asyncio.gather(*(ws_outcome(ws, timeout=idle_s * 3) for ws in holder))
                for messages, code in outcomes:
                    assert code == 4008 and "no audio" in messages[-1]["error"], (messages, code)
                real = None
                for _ in range(40):  # their seats go after the leave grace, like any leaver's
                    try:
                        real, _ = await _ingest(school, live, token, "Real")
                        break
                    except aiohttp.WSServerHandshakeError as error:
                        assert error.status == 429
                        await asyncio.sleep(0.05)
                assert real is not None, "still refused 2 s after the leave grace"
                silence = bytes(640)
                for _ in range(int(3 * idle_s / 0.02)):  # 3 idle times of silence, in real time
                    await real.send_bytes(silence)
                    await asyncio.sleep(0.02)
                assert not real.closed
                await real.close()

        live.run(body())


def test_the_idle_seat_time_is_the_one_security_md_states():
    text = (Path(__file__).resolve().parents[1] / "docs" / "SECURITY.md").read_text()
    row = next(line for line in text.splitlines() if "`--idle-seat`" in line and line.startswith("|"))
    assert f"| {Settings.idle_seat_s:g} s " in row, row


# --- offers per address ----------------------------------------------------------------------------

def test_offers_past_the_per_address_default_get_429(live):
    """offers_per_minute (the default) offers from one address go through to the SDP check; the
    next is a 429 with Retry-After. Another address is counted apart, but not with the same link."""
    limit = Settings.offers_per_minute

    async def offer(session: aiohttp.ClientSession, room: dict, token: str) -> tuple[int, dict, str | None]:
        body = {"token": token, "sdp": "v=0\r\n", "type": "offer", "student_name": "Rtc"}
        async with session.post(f"{live.url}/api/rooms/{room['room_id']}/offer", json=body) as r:
            return r.status, await r.json(), r.headers.get("Retry-After")

    async def until_refused(session: aiohttp.ClientSession, room: dict, token: str, most: int) -> tuple[int, dict, str | None]:
        """Offers until one is refused; the offers that went through, and the refusal."""
        for through in range(most + 1):
            status, answer, retry = await offer(session, room, token)
            if status != 400:
                return through, answer, retry
            assert "no audio" in answer["error"], answer
        raise AssertionError(f"{most + 1} offers went through")

    async def body() -> None:
        room = await live.create_room("offers")
        token = token_of(room["student_url"])
        started = time.monotonic()
        through, answer, retry = await until_refused(live.session, room, token, 2 * limit)
        dry = time.monotonic()  # the address's bucket and the link's are (nearly) empty now
        # The bucket refills at limit/60 a second while the offers are made: that many more go through.
        refilled = (dry - started) * limit / 60
        assert limit <= through <= limit + refilled + 1, (through, refilled)
        assert "address" in answer["error"] and retry is not None and int(retry) >= 1, answer
        other_room = await live.create_room("offers, another link")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as elsewhere:
            status, answer, _ = await offer(elsewhere, other_room, token_of(other_room["student_url"]))
            assert status == 400, answer  # another address, another link: not counted with the first
            through, answer, _ = await until_refused(elsewhere, room, token, limit)
            refilled = (time.monotonic() - dry) * limit / 60  # the link's refill since it ran dry
            assert through <= refilled + 2 and "link" in answer["error"], (through, answer)

    live.run(body(), timeout=120)
