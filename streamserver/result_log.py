"""A log line for each utterance's result as it is published, with its room, student and
utterance as fields (streamserver/logs.py): where the result goes out in this process.

`serve` and a gateway publish through LoggedPublisher: the in-process worker's finals, those
served from their speculation, a fallback's. A worker process publishes a job's result itself,
atomically with its acknowledgement (queue/publication.py), and logs it there (asr/worker.py).
"""

from __future__ import annotations

import logging

from streamserver.bus.ordered import OrderedPublisher
from streamserver.events import RESULT_TYPES, Event, TranscriptEvent
from streamserver.logs import fields

log = logging.getLogger("streamserver.results")


def log_result(event: TranscriptEvent) -> None:
    log.info("%s of utterance %s published", event.type, event.utterance_id,
             extra=fields(room_id=event.room_id, student_id=event.student_id, utterance_id=event.utterance_id))


class LoggedPublisher(OrderedPublisher):
    """The room feed's publisher, logging each result the bus takes."""

    async def publish(self, event: Event) -> bool:
        taken = await super().publish(event)
        if taken and event.type in RESULT_TYPES and isinstance(event, TranscriptEvent):
            log_result(event)
        return taken
