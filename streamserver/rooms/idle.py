"""Idle seats: a stream that brings no audio for a while is ended, and its seat goes with it.

A seat is held by a connection, not by speech, so a client holding a room's link could keep
sockets open and send nothing, and hold seats that real students are then refused (429). Every
honest client sends audio all the time: the WebSocket clients send silence as zeros, and a browser
in DTX (transport/dtx.py) sends a packet at least every 400 ms, whose silence is handed on as
audio. So a stream whose transport has handed on no audio for `idle_s` is ended (close 4008,
a WebRTC peer closed), and its seat is freed after the leave grace like any other leaver's.

Each stream's audio passes through a Heard, which counts the pieces (one call and one addition a
frame); the sweep compares the counts every quarter of `idle_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import TYPE_CHECKING

from streamserver.rooms.connections import Connections

if TYPE_CHECKING:
    import numpy as np

    from streamserver.stages import PcmTaker

log = logging.getLogger(__name__)
CLOSE_IDLE = 4008  # no audio for too long: the seat is freed


class Heard:
    """Stage 1 -> 2 (stages.PcmTaker) of one stream, counting what passes."""

    __slots__ = ("out", "pieces", "__weakref__")

    def __init__(self, out: PcmTaker) -> None:
        self.out = out
        self.pieces = 0

    def push_pcm16(self, pcm: np.ndarray) -> None:
        self.pieces += 1
        self.out.push_pcm16(pcm)


class IdleStreams:
    def __init__(self, connections: Connections, idle_s: float) -> None:
        self.connections, self.idle_s = connections, idle_s
        # a stream's audio (StudentAudio) -> its Heard and (the count last seen, since when)
        self._heard: weakref.WeakKeyDictionary[object, tuple[Heard, list[float]]] = weakref.WeakKeyDictionary()

    def watch(self, audio: PcmTaker) -> PcmTaker:
        """What the transport hands its audio to, in place of `audio`; `audio` itself when idle
        streams are kept (idle_s 0)."""
        if not self.idle_s:
            return audio
        heard = Heard(audio)
        self._heard[audio] = (heard, [0, time.monotonic()])
        return heard

    async def run(self) -> None:
        if not self.idle_s:
            return
        while True:
            await asyncio.sleep(self.idle_s / 4)
            await self.sweep(time.monotonic())

    async def sweep(self, now: float) -> None:
        """End the streams that have handed on nothing for idle_s by `now`."""
        for (room_id, student_id), connection in list(self.connections.items()):
            watched = self._heard.get(connection.audio)
            if watched is None:
                continue
            heard, seen = watched
            if heard.pieces != seen[0]:
                seen[0], seen[1] = heard.pieces, now
            elif now - seen[1] >= self.idle_s and self.connections.get((room_id, student_id)) is connection:
                log.info("student %s of room %s sent no audio for %g s: its stream is ended", student_id, room_id, self.idle_s)
                del self._heard[connection.audio]
                await connection.end(f"no audio for {self.idle_s:g} s: the seat is freed", CLOSE_IDLE)
