"""WebSocket ingest: a student's audio as plain frames over one WebSocket, for on-prem classroom
gateways and the load simulator (a fraction of WebRTC's per-stream cost: no ICE, DTLS or RTP).

Protocol (after the route has checked the student token, see streamserver/api/app.py):
  server -> {"type": "ready", "room_id", "student_id", "sample_rate": 16000, "format": "pcm16"}
  client -> optionally, first, the text {"format": "opus"} (or "pcm16"); answered with
            {"type": "format", "format", "sample_rate"}
  client -> binary messages: little-endian int16 mono 16 kHz PCM of any length (20 ms = 640
            bytes is typical), or with "opus" one Opus packet each (48 kHz; mono or stereo)
A client that keeps its audio to send it again after a break (the load simulator's students, as
the student page does over WebRTC: transport/recovery.py) says so in the format message:
  {"format": ..., "keeps": {"start": F, "now": T, "live_from": L, "clock": C}}: its first sample
  is at stream time F (seconds on its own clock, named C: a new one whenever it starts again at
  0), its clock reads T now, and audio before L is sent again (a reconnect with `catch_up=1` in
  the URL); then
  server -> {"type": "ack", "t": A, "ts": S} every 0.5 s: its audio before A is safe.
A close of the client's with code 1000 or 1001 is a goodbye: its last speech is flushed; a stream
that breaks off keeps it for the client to send again.
Bad input gets {"type": "error", "error": <why>} and a close with one of the codes below; the
stream's audio so far is flushed as usual, and the room keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Awaitable, Callable

import av
import numpy as np
from aiohttp import WSCloseCode, WSMessage, WSMsgType, web
from aiohttp.helpers import DEFAULT_CHUNK_SIZE

try:  # aiohttp's parser and its queue of messages (IngestSocket)
    from aiohttp._websocket.reader import WebSocketDataQueue as _DataQueue, WebSocketReader as _Reader
except ImportError:  # an aiohttp without them: its own socket serves
    _DataQueue = object
    _Reader = None

from streamserver.audio.pacing import TooFast
from streamserver.stages import PcmTaker
from streamserver.audio.timeline import CLOCK_NAME
from streamserver.audio.resample import RATE, To16kMono

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024  # 2 s of PCM16: a client sending more in one message is broken
# aiohttp refuses larger messages itself (close 1009 without our JSON); between the two limits
# the client gets a readable error first.
TRANSPORT_LIMIT_BYTES = 1024 * 1024
CLOSE_BAD_AUDIO = WSCloseCode.INVALID_TEXT  # 1007: a payload that is not what was announced
CLOSE_UNSUPPORTED = WSCloseCode.UNSUPPORTED_DATA  # 1003: a text message we do not understand
CLOSE_TOO_BIG = WSCloseCode.MESSAGE_TOO_BIG  # 1009
CLOSE_TOO_FAST = WSCloseCode.POLICY_VIOLATION  # 1008: audio faster than real time (audio/pacing.py)
CLOSE_REPLACED = 4001  # the same student connected again (over WebSocket or WebRTC)
CLOSE_ROOM_CLOSED = 4003  # the teacher or an admin closed the room
FORMATS = ("pcm16", "opus")


class BadInput(ValueError):
    """What the client sent cannot be used; the message is sent back to it."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Pcm16Decoder:
    def decode(self, data: bytes) -> np.ndarray:
        if len(data) % 2:
            raise BadInput(f"pcm16 messages need an even byte count, got {len(data)}", CLOSE_BAD_AUDIO)
        return np.frombuffer(data, dtype="<i2")


class OpusDecoder:
    """One decoder per stream: Opus carries state from packet to packet."""

    def __init__(self) -> None:
        self._codec = av.CodecContext.create("opus", "r")
        self._codec.sample_rate = 48000
        self._resample = To16kMono()

    def decode(self, data: bytes) -> np.ndarray:
        if not data:
            return np.zeros(0, np.int16)  # PyAV would take an empty packet as end of stream
        try:
            frames = self._codec.decode(av.Packet(data))
        except (av.error.FFmpegError, ValueError) as error:
            raise BadInput(f"not an Opus packet ({error})", CLOSE_BAD_AUDIO) from None
        chunks = [self._resample.push(frame) for frame in frames]
        return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)


MAX_TEXT_CHARS = 256  # {"format": "pcm16"} is 19


def _read_format(text: str) -> tuple[str, dict | None]:
    """The format, and where the client's audio lies on its stream clock if it keeps it."""
    if len(text) > MAX_TEXT_CHARS:
        raise BadInput(f"a text message of {len(text)} characters is over {MAX_TEXT_CHARS}", CLOSE_UNSUPPORTED)
    try:
        message = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError, a number too long; nesting too deep
        message = None
    if not isinstance(message, dict) or message.get("format") not in FORMATS:
        raise BadInput('the only text message is a first {"format": "pcm16"|"opus"}', CLOSE_UNSUPPORTED)
    keeps = message.get("keeps")
    if keeps is None:
        return message["format"], None
    times = {}
    for key in ("start", "now", "live_from"):
        value = keeps.get(key) if isinstance(keeps, dict) else None
        if value is not None and (type(value) not in (int, float) or not 0 <= value < 1e7):
            raise BadInput(f"keeps.{key} must be a stream time in seconds", CLOSE_UNSUPPORTED)
        times[key] = value
    if times["start"] is None or times["now"] is None:
        raise BadInput("keeps needs the stream times start and now", CLOSE_UNSUPPORTED)
    clock = keeps.get("clock", "")
    if not isinstance(clock, str) or not CLOCK_NAME.fullmatch(clock):
        raise BadInput("keeps.clock must be up to 64 letters, digits, - or _", CLOSE_UNSUPPORTED)
    return message["format"], {**times, "clock": clock}


class _DirectQueue(_DataQueue):  # type: ignore[misc, valid-type]
    """aiohttp's queue of one socket's parsed messages, which hands an audio message straight to
    the stream while the stream's task waits for the next message (`take`, set by that task).

    Through the queue, every message costs a future, a wake of the stream's task and its trip
    through aiohttp's receive(): most of a WebSocket student's cost at 60 ms messages. Taken
    here, inside the socket's read, a message costs one call. The order stays the client's: a
    message is taken only while nothing waits in the queue before it, and any other kind of
    message (text, close, ping, an error) goes to the queue and stops the taking until the task
    has handled it. `take` answers False for a message it leaves to the task (the stream was
    replaced); what it raises is kept in `error` for the task, and its message queued to wake it."""

    def __init__(self, protocol: object, limit: int, *, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(protocol, limit, loop=loop)
        self.take: Callable[[bytes], bool] | None = None
        self.error: Exception | None = None

    def feed_data(self, data: WSMessage, size: int) -> None:  # called by aiohttp's reader, once a message is whole
        take = self.take
        if take is not None and data.type is WSMsgType.BINARY and not self._buffer:
            try:
                if take(data.data):
                    return
            except Exception as error:  # noqa: BLE001 - the stream's task raises it, as if it had read the message
                self.error = error
        self.take = None
        super().feed_data(data, size)


HEARTBEAT_FLUSH_S = 1.0  # how often a socket that received something pushes its next ping back


class IngestSocket(web.WebSocketResponse):
    """A student's audio socket: aiohttp's, with its parsed messages going through a _DirectQueue,
    and its heartbeat (a ping after 20 s without a message) pushed back once a second by a timer
    rather than by a callback scheduled for every read. Where aiohttp's internals are not the
    ones this is written for (AIOHTTP_INTERNALS, tests/test_ws_ingest_direct.py), it is
    aiohttp's socket unchanged."""

    _beat: asyncio.TimerHandle | None = None

    def _post_start(self, request: web.BaseRequest, protocol: str | None, writer: object) -> None:
        http = request.protocol
        # bytes after the upgrade request are parsed as it starts: the parser is then not
        # swapped (a client waits for the upgrade's answer before it sends, so this is rare)
        swap = _Reader is not None and getattr(http, "_message_tail", b"?") == b""
        super()._post_start(request, protocol, writer)  # type: ignore[arg-type]
        if not swap or getattr(http, "_payload_parser", None) is not self._parser:
            return
        try:
            queue = _DirectQueue(http, DEFAULT_CHUNK_SIZE, loop=self._loop)
            parser = _Reader(queue, self._max_msg_size, compress=bool(self._compress), decode_text=self._decode_text)
        except (TypeError, AttributeError) as error:  # another aiohttp: its own socket serves
            log.debug("ingest sockets read through aiohttp's queue: %s", error)
            return
        self._reader, self._parser = queue, parser
        http._payload_parser = parser
        if self._heartbeat is not None and http._data_received_cb == self._on_data_received:
            http._data_received_cb = self._data_heard
            self._beat = self._loop.call_later(HEARTBEAT_FLUSH_S, self._push_heartbeat)

    def _data_heard(self) -> None:
        """Called for every read: what aiohttp's own callback does, less its call_soon."""
        self._need_heartbeat_reset = True

    def _push_heartbeat(self) -> None:
        if self._need_heartbeat_reset:  # aiohttp's ping timer waits for this (see _send_heartbeat)
            self._flush_heartbeat_reset()
        self._beat = self._loop.call_later(HEARTBEAT_FLUSH_S, self._push_heartbeat)

    def _cancel_heartbeat(self) -> None:
        super()._cancel_heartbeat()
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None


def new_socket() -> web.WebSocketResponse:
    """The stream's socket, made before the student is seated: the caller checks with
    can_prepare() that the request is a WebSocket upgrade at all before taking a seat. It
    declines permessage-deflate (which aiohttp clients ask for by default): audio barely
    compresses, and inflating every message here and deflating it in the client cost both ends
    more than the bytes saved (the digital zeros of silence) cost the network."""
    return IngestSocket(heartbeat=20, max_msg_size=TRANSPORT_LIMIT_BYTES, compress=False)


Keep = Callable[[dict], Awaitable[None]]


async def serve(
    request: web.Request, ws: web.WebSocketResponse, identity: dict[str, str], stream: PcmTaker,
    current: Callable[[], bool], keep: Keep | None = None, end: Ender | None = None,
) -> web.WebSocketResponse:
    """Run one student's stream until either side closes: decoded 16 kHz PCM goes to `stream`
    while `current()` says this stream is still the student's (a reconnect replaces it).
    `identity` (room_id, student_id, resume) goes into the ready message; `keep` gets the
    stream times of a client that keeps its audio; `end`, the stream's Ender, if the server may
    end it from outside. The caller has checked the token, seated the student and ends the stream
    afterwards."""
    await ws.prepare(request)
    await _stream(ws, identity, stream, current, keep, end or Ender(ws))
    return ws


def said_goodbye(ws: web.WebSocketResponse) -> bool:
    """The client closed the stream on purpose (not a connection that broke off)."""
    return ws.close_code in (WSCloseCode.OK, WSCloseCode.GOING_AWAY)


async def _stream(
    ws: web.WebSocketResponse, identity: dict[str, str], stream: PcmTaker, current: Callable[[], bool],
    keep: Keep | None, end: Ender,
) -> None:
    who = f'{identity["room_id"]}/{identity["student_id"]}'
    await ws.send_json({"type": "ready", **identity, "sample_rate": RATE, "format": "pcm16"})
    replaced: tuple[str, int] | None = None
    try:
        end.reader = asyncio.current_task()
        try:
            if end.why is None:  # not ended before it started
                replaced = await _listen(ws, who, stream, current, keep)
        finally:
            end.reader = None  # from here on the Ender no longer interrupts this task
    except asyncio.CancelledError:
        if not end.interrupted():
            raise
    except BadInput as error:
        await _close(ws, str(error), error.code)
        return
    except Exception:  # a bug of ours must end this stream only, never the room
        log.exception("ingest stream of %s failed", who)
        await _close(ws, "internal error", WSCloseCode.INTERNAL_ERROR)
        return
    why = end.why or replaced
    if why is not None:  # the server ends it: closed from here, the reader (see Ender)
        await _close(ws, *why)


async def _listen(
    ws: web.WebSocketResponse, who: str, stream: PcmTaker, current: Callable[[], bool],
    keep: Keep | None,
) -> tuple[str, int] | None:
    """The client's messages until it closes (or the Ender interrupts this); the reason and code
    to close with if the stream turns out to be replaced."""
    audio = _Audio(stream, current)
    queue = ws._reader if isinstance(ws._reader, _DirectQueue) else None
    first = True
    try:
        while True:
            if queue is not None and not first:  # audio is taken once the format is known
                queue.take = audio.take
            message = await ws.receive()
            if queue is not None:
                queue.take = None
                if queue.error is not None:  # what taking this message raised
                    error, queue.error = queue.error, None
                    raise error
            if message.type in _ENDS:
                return None
            if not current():
                return "replaced by a newer connection of this student", CLOSE_REPLACED
            if message.type == WSMsgType.BINARY:
                audio.take(message.data)
            elif message.type == WSMsgType.TEXT:
                if not first:
                    raise BadInput("a format message must come before any audio", CLOSE_UNSUPPORTED)
                fmt, times = _read_format(message.data)
                if times is not None and keep is not None:
                    await keep(times)  # the audio waits meanwhile: it is fed knowing what it repeats
                audio.decoder = OpusDecoder() if fmt == "opus" else Pcm16Decoder()
                await ws.send_json({"type": "format", "format": fmt, "sample_rate": 48000 if fmt == "opus" else RATE})
            elif message.type == WSMsgType.ERROR:  # e.g. over the transport limit: aiohttp closes with 1009
                log.info("ingest stream of %s: %s", who, ws.exception())
                return None
            first = False
    finally:
        if queue is not None:  # whatever comes now waits unread, as it would in aiohttp's queue
            queue.take = None


_ENDS = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)  # where aiohttp's `async for` stops


class _Audio:
    """A stream's binary messages into its audio path: from its task, or from the socket's read
    (_DirectQueue)."""

    __slots__ = ("stream", "current", "decoder")

    def __init__(self, stream: PcmTaker, current: Callable[[], bool]) -> None:
        self.stream, self.current = stream, current
        self.decoder: Pcm16Decoder | OpusDecoder = Pcm16Decoder()

    def take(self, data: bytes) -> bool:
        """Feed one message; False (nothing done) when the stream is no longer the student's."""
        if not self.current():
            return False
        if len(data) > MAX_MESSAGE_BYTES:
            raise BadInput(f"message of {len(data)} bytes is over {MAX_MESSAGE_BYTES}", CLOSE_TOO_BIG)
        try:
            self.stream.push_pcm16(self.decoder.decode(data))
        except TooFast as error:
            raise BadInput(str(error), CLOSE_TOO_FAST) from None
        return True


class Ender:
    """How the server ends a stream from outside (a reconnect replaced it, the room closed): a
    reason, then a close made by the stream's own task. aiohttp's close() from another task,
    while the reader waits in receive(), drops the connection as soon as its close frame is out:
    the client's answering close frame then meets a closed socket, and an aiohttp client reports
    1006 in place of our code (a replaced tab that takes it for a network break reconnects, and
    replaces the newer tab in turn). Closed by the reader itself, close() reads up to the client's
    close frame first. So the reader is interrupted where it waits (cancelled, and the
    cancellation taken back: see interrupted()) and closes the stream; the caller never waits."""

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self.ws = ws
        self.why: tuple[str, int] | None = None
        # the stream's task while it listens to the client: every await in between lies in
        # _listen, so a cancellation sent while this is set lands there and nowhere else
        self.reader: asyncio.Task | None = None
        self._interrupting = False

    async def __call__(self, reason: str, code: int) -> None:
        self.why = (reason, code)  # a stream not yet started reads it at its start
        if self.reader is not None and not self._interrupting:
            self._interrupting = True
            self.reader.cancel()

    def interrupted(self) -> bool:
        """In the reader, on a CancelledError: whether it is this Ender's (then taken back, so
        that the task goes on to close the stream) rather than the task's own."""
        task = asyncio.current_task()
        if not self._interrupting or task is None or task.cancelling() != 1:
            return False
        task.uncancel()
        return True


async def _close(ws: web.WebSocketResponse, reason: str, code: int) -> None:
    try:
        await ws.send_json({"type": "error", "error": reason})
    except ConnectionError:  # the client is already gone: nothing to tell
        pass
    # a close reason is at most 123 bytes; cut at a character boundary, so that it stays UTF-8
    await ws.close(code=code, message=reason.encode()[:120].decode(errors="ignore").encode())
