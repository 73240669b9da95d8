"""Streams of pages that keep their audio, ended without a goodbye (a network break): their
speech in progress waits PARKED_S for the page to come back and send it again (then it is
dropped: the page's copy comes), and is flushed if it does not. And when a page comes back to
send its audio again, where on its clock its utterances are queued already (audio/sent_again.py)."""

from __future__ import annotations

import asyncio
import logging

from streamserver.audio.pipeline import StudentAudio
from streamserver.bus import Bus
from streamserver.events import RESULT_TYPES, TranscriptEvent, decode, event_type
from streamserver.queue.base import UNREACHABLE, UtteranceQueue
from streamserver.queue.publication import spoken_of

log = logging.getLogger(__name__)
PARKED_S = 30.0  # a page that keeps its audio has this long to come back before its last speech is flushed
RECALL_EVENTS = 500  # of the room's history, read for what a catching-up student had published
RECALL_WAIT_S = 2.0  # a catch-up waits this long at most for where its queued utterances lie


class Parking:
    def __init__(self, queue: UtteranceQueue, bus: Bus, grace_s: float) -> None:
        self.queue, self.bus = queue, bus
        self.wait_s = max(PARKED_S, grace_s)
        self._parked: dict[tuple[str, str], StudentAudio] = {}

    def park(self, audio: StudentAudio) -> None:
        key = (audio.room_id, audio.student_id)
        if (old := self._parked.pop(key, None)) is not None:
            old.close()
        self._parked[key] = audio

        def give_up() -> None:
            if self._parked.get(key) is audio:
                del self._parked[key]
                audio.close()

        asyncio.get_running_loop().call_later(self.wait_s, give_up)

    def take(self, room_id: str, student_id: str) -> StudentAudio | None:
        """The student's parked stream, if any: it is back."""
        return self._parked.pop((room_id, student_id), None)

    async def sent_before(self, room_id: str, student_id: str, clock: str) -> list[tuple[float, float]]:
        """A page sends audio again: where its utterances already queued or published lie on its
        clock. None found when the queue does not answer in time: the check at publication still
        keeps a copy out of the room."""
        await self._recall_spoken(room_id, student_id, clock)
        try:
            return await asyncio.wait_for(self.queue.sent_spans(room_id, spoken_of(student_id, clock)), RECALL_WAIT_S)
        except (*UNREACHABLE, TimeoutError) as error:
            log.warning("queued utterances of student %s not read for its catch-up: %s", student_id, error)
            return []

    async def _recall_spoken(self, room_id: str, student_id: str, clock: str) -> None:
        """A queue that keeps no record of its own (a `serve` that restarted remembers nothing)
        learns from the room's history what of the page's audio is published."""
        if self.queue.keeps_spoken:
            return
        try:
            history = await self.bus.history(room_id, RECALL_EVENTS)
        except Exception as error:  # noqa: BLE001 - the bus is away: the queue's own record decides
            log.warning("history of room %s not read for a catch-up: %s", room_id, error)
            return
        spans = []
        for raw in history:
            if event_type(raw) not in RESULT_TYPES:  # an utterance's result is what says where it lies
                continue
            try:
                event = decode(raw)
            except (ValueError, TypeError):
                continue
            if (isinstance(event, TranscriptEvent) and event.student_id == student_id and event.stream_clock == clock
                    and event.stream_start is not None and event.stream_end is not None):
                spans.append((float(event.stream_start), float(event.stream_end), event.recovered))
        self.queue.remember_spoken(room_id, spoken_of(student_id, clock), spans)
