"""Simulated students on the WebSocket ingest: real-time PCM16 frames paced by the wall clock.

Silence is sent as digital zeros, like a muted or quiet microphone, so the server's VAD sees a
continuous stream and ends each utterance after its own hangover, as it would for a browser.
One Pacer drives every student of the process from a single clock: a timer per frame for all
of them, not one per student (at 20 ms frames, thousands of students would otherwise cost more
in wake-ups than in sending).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from streamserver.loadsim.clients import JoinRefused, token_of
from streamserver.loadsim.scenario import RATE, Turn


@dataclass
class PlayHooks:
    """What the simulator counts while students play (called on the event loop, never blocking)."""

    clip_started: Callable[[str], None] = lambda student_id: None
    clip_sent: Callable[[str, str], None] = lambda student_id, text: None  # its last frame went out; what it says
    lag: Callable[[float], None] = lambda seconds: None  # how late a frame left (simulator overload)


@dataclass
class WsStudent:
    session: aiohttp.ClientSession
    url: str
    room: dict
    name: str
    student_id: str  # the server's, once connected (it issues every id); "" before
    resume: str = ""  # the secret that proves student_id on a reconnect
    closed_by_server: str | None = field(default=None, init=False)  # why, when the server ended it
    _ws: aiohttp.ClientWebSocketResponse | None = field(default=None, init=False, repr=False)
    _reader: asyncio.Task | None = field(default=None, init=False, repr=False)

    async def connect(self, timeout_s: float = 15.0) -> None:
        """Open the stream and wait for "ready"; JoinRefused for an HTTP refusal or an early error."""
        params = {"token": token_of(self.room["student_url"]), "name": self.name}
        if self.resume:  # a reconnect: the same student
            params.update(student_id=self.student_id, resume=self.resume)
        try:
            self._ws = await self.session.ws_connect(
                self.url.replace("http", "ws", 1) + "/ws/ingest", params=params, timeout=aiohttp.ClientWSTimeout(ws_close=5)
            )
            ready = await self._ws.receive(timeout=timeout_s)
        except aiohttp.WSServerHandshakeError as error:
            raise JoinRefused(error.status, error.message) from None
        if ready.type != aiohttp.WSMsgType.TEXT or json.loads(ready.data).get("type") != "ready":
            await self._ws.close()
            raise JoinRefused(0, f"no ready message: {ready.type.name} {str(ready.data)[:200]}")
        identity = json.loads(ready.data)
        self.student_id, self.resume = identity["student_id"], identity.get("resume", "")
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        """Answers the server's pings (autoping works only while reading) and notes why it closed."""
        assert self._ws is not None
        async for message in self._ws:
            if message.type == aiohttp.WSMsgType.TEXT and json.loads(message.data).get("type") == "error":
                self.closed_by_server = json.loads(message.data).get("error", "error")
        if self.closed_by_server is None and self._ws.close_code not in (None, 1000):
            self.closed_by_server = f"closed with code {self._ws.close_code}"

    @property
    def connected(self) -> bool:
        return self._ws is not None and not self._ws.closed

    async def send(self, chunk: bytes) -> bool:
        """False once the stream is gone (the reader notes why)."""
        if not self.connected:
            return False
        try:
            await self._ws.send_bytes(chunk)  # type: ignore[union-attr]
        except (ConnectionError, aiohttp.ClientError):
            return False
        return True

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


@dataclass
class _Stream:
    """One student's position in its plan: which frame goes next, and of which clip."""

    student: WsStudent
    frames: int  # the stream's length in frames
    starts: dict[int, Turn]  # frame index -> the turn that starts there
    first_tick: int
    done: asyncio.Future
    sent: int = 0
    clip: bytes = b""
    offset: int = 0
    text: str = ""  # what the clip being sent says


class Pacer:
    """Frame k of a student that joined at tick j leaves at tick j + k of one shared clock."""

    def __init__(self, frame_ms: int, hooks: PlayHooks) -> None:
        self.frame_bytes = RATE * frame_ms // 1000 * 2
        self.frame_s = frame_ms / 1000
        self.hooks = hooks
        self._silence = bytes(self.frame_bytes)
        self._streams: list[_Stream] = []
        self._task: asyncio.Task | None = None
        self._begin = 0.0

    async def play(self, student: WsStudent, turns: list[Turn], length_s: float) -> None:
        """Stream `length_s` of audio from the next tick: the turns' clips at their times,
        silence between. Returns when it is all sent or the stream is gone."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._begin = loop.time()
            self._task = loop.create_task(self._run())
        stream = _Stream(student, int(length_s / self.frame_s), {round(t.start_s / self.frame_s): t for t in turns},
                         self._tick_now() + 1, loop.create_future())
        self._streams.append(stream)
        await stream.done

    def _tick_now(self) -> int:
        return int((asyncio.get_running_loop().time() - self._begin) / self.frame_s)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        tick = 0
        while self._streams:
            tick += 1
            delay = self._begin + tick * self.frame_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -self.frame_s:
                self.hooks.lag(-delay)
            due = self._tick_now()  # after a late wake-up, every frame that is due goes now
            for stream in list(self._streams):
                alive = True
                while alive and stream.sent < min(due - stream.first_tick + 1, stream.frames):
                    alive = await self._send_next(stream)
                if not alive or stream.sent >= stream.frames:
                    self._streams.remove(stream)
                    if not stream.done.done():  # its player may have been cancelled
                        stream.done.set_result(None)
            tick = max(tick, due)

    async def _send_next(self, s: _Stream) -> bool:
        if not s.clip and s.sent in s.starts:
            s.clip, s.offset, s.text = s.starts[s.sent].clip.pcm, 0, s.starts[s.sent].clip.text
            self.hooks.clip_started(s.student.student_id)
        if s.clip:
            chunk, s.offset = s.clip[s.offset : s.offset + self.frame_bytes], s.offset + self.frame_bytes
        else:
            chunk = self._silence
        if not await s.student.send(chunk):
            return False
        s.sent += 1
        if s.clip and s.offset >= len(s.clip):
            s.clip = b""
            self.hooks.clip_sent(s.student.student_id, s.text)  # counted once its last frame is on the wire
        return True
