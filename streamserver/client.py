"""A small asyncio client of a streamserver: students over the WebSocket ingest, the teacher's
feed, and the room calls of the admin API.

    async with Feed(teacher_link) as feed, Student(student_link, "Ann") as ann:
        await ann.play("question.wav")
        async for t in feed.transcripts(idle_s=5):
            print(t["student_name"], t["text"])

A room's links (`create_room`) carry the server, the room and the token, so a Student or a Feed
needs nothing else. A Student keeps the audio it sent until the server acknowledges it
(docs/api.md, the WebSocket ingest): when its stream breaks it reconnects as the same student
and sends the rest again, so a network blip costs no words. A Feed is an async iterator over the
room's events, the replayed history first; when it breaks it reconnects and replays, and yields
nothing twice. The load simulator (streamserver/loadsim/) builds its join and feed requests here.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, AsyncIterator
from urllib.parse import parse_qs, urlsplit

import aiohttp
import numpy as np

from streamserver.audio.resample import RATE  # the ingest's PCM16: mono, 16 kHz
from streamserver.events import RESULT_TYPES, TranscriptEvent, TranscriptPartialEvent
from streamserver.transport.ws_ingest import CLOSE_ROOM_CLOSED  # the teacher or an admin closed the room

CHUNK_S = 0.1  # one message per 100 ms of audio, as a microphone sends it
CATCH_UP_RATE = 1.4  # x real time for audio sent again (the server takes up to 1.5x)
CLOSE_BREAK = 4000  # not a goodbye: the server keeps the speech in progress for the resend
RECONNECT_ATTEMPTS = 8


class ClientError(Exception):
    """The server refused a request: its HTTP status (0: no HTTP answer) and its reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status


def link_param(link: str, key: str) -> str:
    """A value a room link carries: in its fragment (`#room=…&token=…`), or in the query of a link
    of an older server."""
    parts = urlsplit(link)
    for part in (parts.fragment, parts.query):
        if values := parse_qs(part).get(key):
            return values[0]
    raise ValueError(f"the link {parts.path} carries no {key}")


def token_of(link: str) -> str:
    return link_param(link, "token")


def server_of(link: str) -> str:
    """http(s)://host:port of a link."""
    parts = urlsplit(link)
    return f"{parts.scheme}://{parts.netloc}"


def admin_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def ingest_url(server: str) -> str:
    return server.replace("http", "ws", 1) + "/ws/ingest"


def ingest_params(token: str, name: str, student_id: str = "", resume: str = "", catch_up: bool = False) -> dict[str, str]:
    """The query of a join over the WebSocket ingest: a reconnect names the student and proves it
    with its resume secret; `catch_up` announces audio sent again."""
    params = {"token": token, "name": name}
    if resume:
        params.update(student_id=student_id, resume=resume)
    if catch_up:
        params["catch_up"] = "1"
    return params


def feed_url(server: str, room_id: str, teacher_token: str) -> str:
    return server.replace("http", "ws", 1) + f"/api/rooms/{room_id}/feed?token={teacher_token}"


@dataclass(frozen=True)
class RoomLinks:
    room_id: str
    name: str
    language: str
    teacher_url: str
    student_url: str


async def create_room(server: str, admin_token: str, name: str, language: str = "en",
                      max_students: int | None = None) -> RoomLinks:
    """A room and its links (POST /api/rooms with the admin token)."""
    body: dict[str, Any] = {"name": name, "language": language}
    if max_students is not None:
        body["max_students"] = max_students
    async with aiohttp.ClientSession() as session, \
            session.post(f"{server}/api/rooms", json=body, headers=admin_headers(admin_token)) as r:
        if r.status != 201:
            raise ClientError(r.status, await r.text())
        room = await r.json()
    return RoomLinks(room["room_id"], room["name"], room["language"], room["teacher_url"], room["student_url"])


async def close_room(teacher_link_or_server: str, admin_token: str | None = None, room_id: str | None = None) -> None:
    """Close a room: with its teacher link, or a server, the admin token and the room's id."""
    if admin_token is None:
        server, room_id, token = server_of(teacher_link_or_server), link_param(teacher_link_or_server, "room"), \
            token_of(teacher_link_or_server)
    else:
        server, token = teacher_link_or_server, admin_token
    async with aiohttp.ClientSession() as session, \
            session.delete(f"{server}/api/rooms/{room_id}", headers=admin_headers(token)) as r:
        if r.status != 200:
            raise ClientError(r.status, await r.text())


def pcm16(path: str | Path, tail_s: float = 1.0) -> bytes:
    """Any audio file PyAV reads as the ingest's PCM16, with `tail_s` of silence after it: an
    open microphone's quiet, after which the server's VAD ends the utterance."""
    from engines.audio import load_audio  # PyAV: only for files

    audio = np.concatenate([load_audio(path), np.zeros(int(tail_s * RATE), np.float32)])
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


class Student:
    """One student on the WebSocket ingest, as an async context manager: `send` PCM16 as it is
    captured, or `play` a file in real time; leaving the context says goodbye (the server
    transcribes the last words)."""

    def __init__(self, student_link: str, name: str, session: aiohttp.ClientSession | None = None) -> None:
        self.server, self.name, self.token = server_of(student_link), name, token_of(student_link)
        self.student_id = ""  # the server's, from its ready message
        self.resume = ""  # proves student_id on a reconnect
        self.reconnects = 0
        self.closed_by_server: str | None = None  # why, when the server ended the stream
        self._session, self._own_session = session, session is None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._clock = secrets.token_hex(8)  # names this stream's clock for the server's acks
        # audio kept for a resend: PCM16 samples [_kept_from, _written); the server acknowledged
        # those before _acked; those before _sent went out on this connection
        self._kept = bytearray()
        self._kept_from = self._written = self._sent = self._acked = 0

    @property
    def acknowledged_s(self) -> float:
        """Seconds of audio the server has taken safely."""
        return self._acked / RATE

    async def __aenter__(self) -> Student:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        await self._connect(catch_up=False)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def _connect(self, catch_up: bool) -> None:
        assert self._session is not None
        params = ingest_params(self.token, self.name, self.student_id, self.resume, catch_up)
        try:
            ws = await self._session.ws_connect(ingest_url(self.server), params=params)
        except aiohttp.WSServerHandshakeError as error:
            raise ClientError(error.status, error.message) from None
        ready = await ws.receive(timeout=15)
        if ready.type != aiohttp.WSMsgType.TEXT or json.loads(ready.data).get("type") != "ready":
            await ws.close()
            raise ClientError(0, f"no ready message: {ready.type.name} {str(ready.data)[:200]}")
        identity = json.loads(ready.data)
        self.student_id, self.resume = identity["student_id"], identity.get("resume", "")
        self._sent = max(self._acked, self._kept_from)  # the rest goes out again
        now = self._written / RATE
        keeps = {"start": self._sent / RATE, "now": now, "live_from": now if catch_up else None, "clock": self._clock}
        await ws.send_str(json.dumps({"format": "pcm16", "keeps": keeps}))
        self._ws = ws
        self._reader = asyncio.create_task(self._read(ws))

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Takes the acks (and answers pings, which only a reading client does)."""
        async for message in ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            body = json.loads(message.data)
            if body.get("type") == "ack" and isinstance(body.get("t"), (int, float)):
                self._acked = max(self._acked, round(body["t"] * RATE))
                drop = min(self._acked, self._sent) - self._kept_from
                if drop >= RATE:  # forgotten in whole seconds, not at every ack
                    del self._kept[: drop * 2]
                    self._kept_from += drop
            elif body.get("type") == "error":
                self.closed_by_server = str(body.get("error"))
        if ws.close_code == CLOSE_ROOM_CLOSED:
            self.closed_by_server = self.closed_by_server or "the room was closed"

    async def send(self, pcm: bytes) -> None:
        """PCM16 (mono, 16 kHz, little-endian) as it is captured: kept until acknowledged, and
        sent again after a reconnect when the stream breaks."""
        if len(pcm) % 2:
            raise ValueError("PCM16 has an even number of bytes")
        self._kept += pcm
        self._written += len(pcm) // 2
        if self._sent == self._written - len(pcm) // 2 and await self._send_bytes(pcm):
            self._sent = self._written
            return
        await self._reconnect()

    async def _send_bytes(self, pcm: bytes) -> bool:
        if self._ws is None or self._ws.closed:
            return False
        try:
            await self._ws.send_bytes(pcm)
        except (ConnectionError, aiohttp.ClientError):
            return False
        return True

    async def _reconnect(self) -> None:
        """As the same student, then what was not acknowledged, paced, up to the live audio."""
        for attempt in range(RECONNECT_ATTEMPTS):
            if self.closed_by_server is not None:
                raise ClientError(0, f"the server ended the stream: {self.closed_by_server}")
            await self._drop_connection()
            await asyncio.sleep(min(5.0, 0.25 * 2 ** attempt))
            try:
                await self._connect(catch_up=True)
            except (ClientError, aiohttp.ClientError, OSError, asyncio.TimeoutError):
                continue
            self.reconnects += 1
            began, start = time.monotonic(), self._sent
            piece = int(CHUNK_S * RATE)
            while self._sent < self._written:
                at = (self._sent - self._kept_from) * 2
                end = min(self._sent + piece, self._written)
                if not await self._send_bytes(bytes(self._kept[at : at + (end - self._sent) * 2])):
                    break
                self._sent = end
                ahead = (self._sent - start) / RATE / CATCH_UP_RATE - (time.monotonic() - began)
                if ahead > 0:
                    await asyncio.sleep(ahead)
            if self._sent == self._written:
                return
        raise ClientError(0, f"no connection to {self.server} after {RECONNECT_ATTEMPTS} attempts")

    async def _drop_connection(self) -> None:
        if self._ws is not None and not self._ws.closed:
            await asyncio.gather(asyncio.wait_for(self._ws.close(code=CLOSE_BREAK), 0.5), return_exceptions=True)
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def play(self, audio: str | Path | bytes, tail_s: float = 1.0) -> None:
        """A file (any format PyAV reads) or PCM16 bytes, in real time, in 100 ms messages."""
        pcm = audio if isinstance(audio, bytes) else pcm16(audio, tail_s)
        step = int(CHUNK_S * RATE) * 2
        began = time.monotonic()
        for n, at in enumerate(range(0, len(pcm), step)):
            await self.send(pcm[at : at + step])
            ahead = began + (n + 1) * CHUNK_S - time.monotonic()  # paced by the wall clock, as a microphone
            if ahead > 0:
                await asyncio.sleep(ahead)
            else:  # late (a reconnect and its resend took the time): the rest follows at 1x, not in a burst
                began -= ahead

    async def close(self) -> None:
        """Goodbye (close 1000): the server transcribes the last utterance."""
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._own_session and self._session is not None:
            await self._session.close()


class Feed:
    """A teacher's feed as an async context manager and iterator over the room's events (dicts,
    as docs/api.md describes them): the replayed history first, then live ones. A roster and a
    history are not yielded themselves; `roster` keeps the latest."""

    def __init__(self, teacher_link: str, session: aiohttp.ClientSession | None = None) -> None:
        self.server, self.room_id, self.token = server_of(teacher_link), link_param(teacher_link, "room"), token_of(teacher_link)
        self.roster: dict[str, Any] = {}
        self.reconnects = 0
        self._session, self._own_session = session, session is None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._seen_events: set[str] = set()
        self._seen_results: set[str] = set()
        self._closing = False

    async def __aenter__(self) -> Feed:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        await self._open()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def _open(self) -> None:
        assert self._session is not None
        try:
            self._ws = await self._session.ws_connect(feed_url(self.server, self.room_id, self.token), max_msg_size=0)
        except aiohttp.WSServerHandshakeError as error:
            raise ClientError(error.status, error.message) from None

    def _first(self, event: dict[str, Any]) -> bool:
        """Whether the event is new to this feed: a reconnect replays the history."""
        if event.get("type") in RESULT_TYPES:
            key = str(event.get("utterance_id"))
            seen = self._seen_results
        else:
            key = json.dumps(event, sort_keys=True)
            seen = self._seen_events
        if key in seen:
            return False
        seen.add(key)
        return event.get("type") != TranscriptPartialEvent.type or str(event.get("utterance_id")) not in self._seen_results

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self.events()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every event once, until the room is closed or `close` is called."""
        while not self._closing:
            ws = self._ws
            assert ws is not None
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                event = json.loads(message.data)
                if event.get("type") == "roster":  # the students now
                    self.roster = event
                    continue
                for one in event["events"] if event.get("type") == "history" else [event]:
                    if self._first(one):
                        yield one
            if self._closing or ws.close_code == CLOSE_ROOM_CLOSED:
                return
            for attempt in range(RECONNECT_ATTEMPTS):  # the gateway went away: again, and replay
                await asyncio.sleep(min(5.0, 0.25 * 2 ** attempt))
                try:
                    await self._open()
                    break
                except (ClientError, aiohttp.ClientError, OSError):
                    continue
            else:
                raise ClientError(0, f"the feed of room {self.room_id} could not be opened again")
            self.reconnects += 1

    async def transcripts(self, idle_s: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """The final transcripts; with `idle_s`, it ends when none has come for that long."""
        events = self.events()
        loop = asyncio.get_running_loop()
        deadline = None if idle_s is None else loop.time() + idle_s
        try:
            while True:
                try:  # partials and other events do not extend the wait: only a final does
                    wait = None if deadline is None else max(0.0, deadline - loop.time())
                    event = await asyncio.wait_for(anext(events), wait)
                except (StopAsyncIteration, asyncio.TimeoutError):
                    return
                if event.get("type") == TranscriptEvent.type:
                    if idle_s is not None:
                        deadline = loop.time() + idle_s
                    yield event
        finally:
            await events.aclose()

    async def close(self) -> None:
        self._closing = True
        if self._ws is not None:
            await self._ws.close()
        if self._own_session and self._session is not None:
            await self._session.close()
