"""Simulated students on the WebSocket ingest: real-time PCM16 frames paced by the wall clock.

A student that keeps its audio (`keeps`, as the student page does over WebRTC) counts what it
said on its own clock, learns from the server's acks how far it is safe, and after any break (the
stream closed, or its acks stopped: AckWatch) reconnects, through the next of its servers' URLs
when it has several, after a jittered wait that doubles with each failed attempt (a gateway that
restarts must not get its whole room back in one second), and sends the rest again before its
live audio (transport/ws_ingest.py).

Silence is sent as digital zeros, like a muted or quiet microphone, so the server's VAD sees a
continuous stream and ends each utterance after its own hangover, as it would for a browser.
One Pacer drives every student of the process from a single clock: a timer per frame for all
of them, not one per student (at short frames, thousands of students would otherwise cost more
in wake-ups than in sending).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from streamserver.client import CATCH_UP_RATE, ingest_params, ingest_url
from streamserver.loadsim.clients import JoinRefused, next_url, token_of
from streamserver.loadsim.scenario import RATE, Turn

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # no ack this long from a server whose acks come on time: it is gone
SLOW_ACKS = 3.0  # ... from one whose acks came late, this many times its longest recent gap
SILENCE_S = 10.0  # ... and never longer than this
KEEP_S = 60.0  # audio kept for sending again, as the page
CATCH_UP_PIECE = RATE // 10  # samples (100 ms) per message of a catch-up
RECONNECT_FIRST_S = 0.5  # a break's first attempt comes within this (jittered)
RECONNECT_MAX_S = 10.0  # the doubling wait between failed attempts stops growing here


def reconnect_wait(attempt: int, retry_after_s: float = 0.0) -> float:
    """Seconds before reconnect attempt `attempt` (0: the first after a break): a random share of
    a window that doubles with each failed attempt ("full jitter"), so that the students of a
    gateway that broke come back spread out, not in one wave; a server's Retry-After is a
    floor, spread over half as much again."""
    if retry_after_s > 0:
        return retry_after_s * random.uniform(1.0, 1.5)
    return random.uniform(0.0, min(RECONNECT_MAX_S, RECONNECT_FIRST_S * 2 ** attempt))


class AckWatch:
    """Whether a server that acknowledges every ACK_EVERY_S (transport/recovery.py) is gone.
    A server that is merely slow (its event loop runs late under load) acks late, not never:
    the wait grows with the gaps it has shown lately, so that a busy gateway is not left by all
    of its students at once (which makes it busier still), while one that acked on time and
    then stopped is left after HEARTBEAT_S. A dead process closes its sockets, which the
    stream's reader sees at once. Only time this client was running counts: while its own event
    loop was late (a simulator process busy with a thousand handshakes, a browser's background
    tab), acks may be waiting unread in its socket."""

    CHECK_SLACK_S = 0.2  # checks come every frame: a longer pause between two is this client's own

    def __init__(self) -> None:
        self.last = self._checked = time.monotonic()
        self._gaps: deque[float] = deque(maxlen=20)

    def heard(self) -> None:
        now = time.monotonic()
        self._gaps.append(now - self.last)
        self.last = now

    def restart(self) -> None:
        """A new connection: its first ack is awaited from now."""
        self.last = self._checked = time.monotonic()

    def window(self) -> float:
        return min(SILENCE_S, max(HEARTBEAT_S, SLOW_ACKS * max(self._gaps, default=0.0)))

    def silent(self) -> bool:
        now = time.monotonic()
        self.last += max(0.0, now - self._checked - self.CHECK_SLACK_S)  # the time we were not running
        self._checked = now
        return now - self.last > self.window()


@dataclass
class PlayHooks:
    """What the simulator counts while students play (called on the event loop, never blocking)."""

    clip_started: Callable[[str, float], None] = lambda student_id, onset_s: None  # its first frame goes out now; its speech onset_s later
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
    keeps: bool = False  # keeps its audio and sends it again after a break
    urls: list[str] = field(default_factory=list)  # servers to reconnect through, in turn (default: url)
    closed_by_server: str | None = field(default=None, init=False)  # why, when the server ended it
    reconnects: int = field(default=0, init=False)
    breaks: Counter = field(default_factory=Counter, init=False)  # why it reconnected: "closed", "no_ack", "send_failed"
    resent_s: float = field(default=0.0, init=False)  # audio sent again after breaks
    _ws: aiohttp.ClientWebSocketResponse | None = field(default=None, init=False, repr=False)
    _reader: asyncio.Task | None = field(default=None, init=False, repr=False)
    # kept audio: PCM16 bytes of samples [_kept_from, _written), of which [.., _sent) went out on
    # this connection; the server acknowledged everything before _ack (samples)
    _kept: bytearray = field(default_factory=bytearray, init=False, repr=False)
    _kept_from: int = field(default=0, init=False, repr=False)
    _written: int = field(default=0, init=False, repr=False)
    _sent: int = field(default=0, init=False, repr=False)
    _ack: int = field(default=0, init=False, repr=False)
    _acks: AckWatch = field(default_factory=AckWatch, init=False, repr=False)
    _recovery: asyncio.Task | None = field(default=None, init=False, repr=False)
    _ending: bool = field(default=False, init=False, repr=False)
    _clock: str = field(default_factory=lambda: secrets.token_hex(8), init=False, repr=False)  # this clock's name

    async def connect(self, timeout_s: float = 15.0, catch_up: bool = False) -> None:
        """Open the stream and wait for "ready"; JoinRefused for an HTTP refusal or an early error."""
        # a reconnect (resume given) is the same student
        params = ingest_params(token_of(self.room["student_url"]), self.name, self.student_id, self.resume, catch_up)
        try:
            self._ws = await self.session.ws_connect(
                ingest_url(self.url), params=params, timeout=aiohttp.ClientWSTimeout(ws_close=5)
            )
            ready = await self._ws.receive(timeout=timeout_s)
        except aiohttp.WSServerHandshakeError as error:
            raise JoinRefused(error.status, error.message, (error.headers or {}).get("Retry-After")) from None
        if ready.type != aiohttp.WSMsgType.TEXT or json.loads(ready.data).get("type") != "ready":
            await self._ws.close()
            raise JoinRefused(0, f"no ready message: {ready.type.name} {str(ready.data)[:200]}")
        identity = json.loads(ready.data)
        self.student_id, self.resume = identity["student_id"], identity.get("resume", "")
        if self.keeps:
            self._sent = max(self._ack, self._kept_from)
            now_s = self._written / RATE
            keeps = {"start": self._sent / RATE, "now": now_s, "live_from": now_s if catch_up else None, "clock": self._clock}
            await self._ws.send_str(json.dumps({"format": "pcm16", "keeps": keeps}))
            self._acks.restart()
        self._reader = asyncio.create_task(self._read(self._ws))

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Answers the server's pings (autoping works only while reading), takes its acks, and
        notes why it closed."""
        async for message in ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            body = json.loads(message.data)
            if body.get("type") == "error":
                self.closed_by_server = body.get("error", "error")
            elif body.get("type") == "ack":
                self._acks.heard()
                if isinstance(body.get("t"), (int, float)):
                    self._ack = max(self._ack, round(body["t"] * RATE))
                    self._forget()
        if self.keeps and not self._ending and ws is self._ws:
            self._break("closed")
            return
        if self.closed_by_server is None and ws.close_code not in (None, 1000):
            self.closed_by_server = f"closed with code {ws.close_code}"

    @property
    def connected(self) -> bool:
        return self._ws is not None and not self._ws.closed

    async def send(self, chunk: bytes) -> bool:
        """False once the stream is gone (the reader notes why). A student that keeps its audio
        keeps talking through a break: what it says goes out once it is back."""
        if not self.keeps:
            return await self._send_bytes(chunk)
        self._kept += chunk
        self._written += len(chunk) // 2
        if self._recovery is None and self.connected and self._acks.silent():
            self._break("no_ack")
        if self._recovery is None and self._sent == self._written - len(chunk) // 2:
            if await self._send_bytes(chunk):
                self._sent = self._written
            elif not self._ending:
                self._break("send_failed")
        return True

    async def _send_bytes(self, chunk: bytes) -> bool:
        if not self.connected:
            return False
        try:
            await self._ws.send_bytes(chunk)  # type: ignore[union-attr]
        except (ConnectionError, aiohttp.ClientError):
            return False
        return True

    def _forget(self) -> None:
        """Audio acknowledged, and audio older than KEEP_S, is not kept."""
        drop = min(max(self._ack, self._written - int(KEEP_S * RATE)), self._sent) - self._kept_from
        if drop > RATE:  # in whole seconds' worth, not per ack
            del self._kept[: drop * 2]
            self._kept_from += drop

    def _break(self, why: str) -> None:
        if self._recovery is None or self._recovery.done():
            log.debug("student %s: %s; reconnecting", self.student_id, why)
            self.breaks[why] += 1
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        """Reconnect (the next URL after a failed attempt) and send what was not acknowledged,
        paced, up to the live audio; the live audio then goes straight out again."""
        urls = self.urls or [self.url]
        attempt, retry_after = 0, 0.0
        while not self._ending:
            old = self._ws
            if old is not None and not old.closed:  # not a goodbye: the server keeps our speech in progress
                await asyncio.gather(asyncio.wait_for(old.close(code=4000), 0.5), return_exceptions=True)
            await asyncio.sleep(reconnect_wait(attempt, retry_after))
            try:
                await self.connect(catch_up=True)
            except (JoinRefused, aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
                log.debug("student %s: reconnect through %s failed: %s", self.student_id, self.url, error)
                retry_after = error.retry_after_s if isinstance(error, JoinRefused) else 0.0
                attempt += 1
                self.url = next_url(urls, self.url)
                continue
            self.reconnects += 1
            began, start = time.monotonic(), self._sent
            self.resent_s += (self._written - self._sent) / RATE  # what the break held back
            while self._sent < self._written and self.connected:
                piece = min(CATCH_UP_PIECE, self._written - self._sent)
                at = (self._sent - self._kept_from) * 2
                if not await self._send_bytes(bytes(self._kept[at : at + piece * 2])):
                    break
                self._sent += piece
                ahead = (self._sent - start) / RATE / CATCH_UP_RATE - (time.monotonic() - began)
                if ahead > 0:
                    await asyncio.sleep(ahead)
            if self._sent >= self._written and self.connected:
                break  # caught up: send() takes over
        self._recovery = None

    async def close(self) -> None:
        if self.keeps and self._recovery is not None:  # what it said during a break goes out first
            try:
                await asyncio.wait_for(asyncio.shield(self._recovery), 60)
            except asyncio.TimeoutError:
                log.warning("student %s: catch-up not finished at the end", self.student_id)
        self._ending = True
        if self._recovery is not None:
            self._recovery.cancel()
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
            clip = s.starts[s.sent].clip
            s.clip, s.offset, s.text = clip.pcm, 0, clip.text
            self.hooks.clip_started(s.student.student_id, clip.onset_s)
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
