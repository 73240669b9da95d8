"""The probes of issue 33 fail: one holder of a student link cannot take a room's seats (per-student
links, idle seats freed), the teacher's feed keeps its message limit and closes on a protocol
violation, and offers are limited per address (names: tests/test_hostile_input.py). Real app (tests/live_app.py,
the tiny.en engine), real sockets; the raw WebSocket frames are written byte for byte."""

from __future__ import annotations

import asyncio
import base64
import os
import struct

import aiohttp
import pytest

from streamserver.api.feed_socket import FEED_MESSAGE_LIMIT_BYTES
from streamserver.loadsim.clients import token_of
from tests.live_app import live_app


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
