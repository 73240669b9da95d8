"""The recovery channel beside a student's WebRTC audio: a data channel named "recovery" that the
student's page opens in the same peer connection (so it always reaches the process that has the
audio, whatever balances the load).

page -> server (JSON text, unless said otherwise):
  {"type": "mark", "t": T}        the page's newest microphone sample is at stream time T (seconds
                                  on its own clock, audio/timeline.py): 8 at 250 ms, then every 5 s;
                                  the first places the live audio, each dates what is sent again
  {"type": "catchup", "from": F}  after a reconnect: what the server had not acknowledged follows,
  binary messages                 from stream time F: 16 kHz mono little-endian PCM16,
  {"type": "caught_up"}           up to the live audio's start (live_from); then the live audio
                                  goes on (it was held meanwhile)
  {"type": "bye"}                 the student leaves: the speech in progress is flushed
server -> page:
  {"type": "live_from", "t": L}   where this connection's live audio starts on the stream clock
  {"type": "ack", "t": A, "ts": S} every ACK_EVERY_S: the page's audio before A is safe (in a
                                  published transcript, or not speech); also the page's heartbeat
  {"type": "error", "error": why} a message it cannot use (the channel closes after it)
  {"type": "ended", "code": C, "error": why}  the server ended this connection for good: C is
                                  the WebSocket ingest's close code (4001: the student connected
                                  again elsewhere, e.g. a duplicated tab; 4003: the room closed);
                                  the page stops instead of reconnecting
A catch-up is paced as any stream (audio/pacing.py, up to 1.5x real time), counted apart from the
live audio it runs beside.
"""

from __future__ import annotations

import json
import logging
from typing import Awaitable, Callable

import numpy as np

from streamserver.audio.pacing import Pacer, TooFast
from streamserver.audio.pipeline import StudentAudio
from streamserver.transport.webrtc import UNDECODABLE, close_soon
from streamserver.transport.ws_ingest import CLOSE_REPLACED, CLOSE_ROOM_CLOSED

log = logging.getLogger(__name__)

LABEL = "recovery"
ACK_EVERY_S = 0.5
MAX_BINARY_BYTES = 64 * 1024  # 2 s of PCM16
MAX_TEXT_CHARS = 256
PEER_TOLD_S = 0.5  # a page's "ended" message has this long to get out before its peer closes


class ChannelError(ValueError):
    """A message the channel cannot use."""


def handle(audio: StudentAudio, message: str | bytes, send: Callable[[dict], object],
           pacer: Callable[[], Pacer]) -> None:
    """One message of the page's recovery channel. ChannelError (and TooFast) for one it cannot use."""
    if isinstance(message, bytes):
        if len(message) > MAX_BINARY_BYTES or len(message) % 2:
            raise ChannelError(f"catch-up audio must be PCM16 pieces of at most {MAX_BINARY_BYTES} bytes")
        try:
            audio.push_catch_up(np.frombuffer(message, "<i2"))
        except ValueError as error:
            raise ChannelError(str(error)) from None
        return
    if len(message) > MAX_TEXT_CHARS:
        raise ChannelError(f"a text message of {len(message)} characters is over {MAX_TEXT_CHARS}")
    try:
        body = json.loads(message)
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict):
        raise ChannelError("messages are JSON objects")
    kind = body.get("type")
    if kind == "mark":
        live_from = audio.mark(_time(body, "t"))
        if live_from is not None and not audio.live_from_told:
            audio.live_from_told = True
            send({"type": "live_from", "t": round(live_from, 4)})
    elif kind == "catchup":
        if not audio.catching_up:
            raise ChannelError("a catch-up needs an offer that announced it (recovery.catch_up)")
        try:
            audio.start_catch_up(_time(body, "from"), pacer())
        except ValueError as error:
            raise ChannelError(str(error)) from None
        log.info("student %s sends its audio again from %.1f s of its clock", audio.student_id, body["from"])
    elif kind == "caught_up":
        audio.end_catch_up(complete=True)
        log.info("student %s caught up", audio.student_id)
    elif kind == "bye":
        audio.said_bye = True
    else:
        raise ChannelError(f"unknown message type {kind!r}")


def _time(body: dict, key: str) -> float:
    value = body.get(key)
    if type(value) not in (int, float) or not 0 <= value < 1e7:
        raise ChannelError(f"{key!r} must be a stream time in seconds")
    return float(value)


def attach(channel, audio: StudentAudio, pacer: Callable[[], Pacer]) -> Callable[[dict], bool]:  # noqa: ANN001 - aiortc RTCDataChannel
    """Serve the page's recovery channel; the function that sends it a message (False: the
    channel is not open, nothing sent)."""

    def send(message: dict) -> bool:
        if channel.readyState != "open":
            return False
        channel.send(json.dumps(message))
        return True

    def refuse(error: Exception) -> None:
        log.warning("closing the recovery channel of student %s: %s", audio.student_id, error)
        send({"type": "error", "error": str(error)})
        audio.end_catch_up()  # the live audio is never held for a broken catch-up
        channel.close()

    @channel.on("message")
    def on_message(message: str | bytes) -> None:
        try:
            handle(audio, message, send, pacer)
        except (ChannelError, TooFast) as error:
            refuse(error)
        except Exception:  # a bug of ours costs this message, never the room
            log.exception("recovery message of student %s failed", audio.student_id)

    @channel.on(UNDECODABLE)
    def on_undecodable() -> None:
        refuse(ChannelError("a text message must be UTF-8"))

    return send


def teller(send: Callable[[dict], bool]) -> Callable[[dict], Awaitable[bool]]:
    """attach()'s send, as the classroom tells any client (rooms/connections.py Tell)."""

    async def tell(message: dict) -> bool:
        return send(message)

    return tell


async def end_peer(pc, tell: Callable[[dict], Awaitable[bool | None]] | None, reason: str, code: int) -> None:  # noqa: ANN001 - aiortc's RTCPeerConnection
    """End a student's WebRTC peer from the server's side. A page told on its recovery channel
    that it was replaced or that its room closed stops there ("ended"); told nothing, it takes
    the closed peer for a network break and connects again, and a duplicated tab (the same
    identity: a browser copies a tab's sessionStorage) would take the seat back, then the other
    tab, and so on. The peer closes PEER_TOLD_S later, in the background: closed at once, SCTP
    drops what it has not sent."""
    told = False
    if code in (CLOSE_REPLACED, CLOSE_ROOM_CLOSED) and tell is not None:
        told = bool(await tell({"type": "ended", "code": code, "error": reason}))
    if not told:  # no channel open (a page without one, or not yet): it just closes
        await pc.close()
        return
    close_soon(pc, PEER_TOLD_S)
