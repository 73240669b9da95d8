"""Publishing a room's events in the order they were made.

speaking_started and speaking_stopped are published from tasks made back to back, and two
publishes on a connection pool can overtake each other (a dashboard then shows a student
speaking who has stopped). One FIFO lock per room (asyncio.Lock wakes waiters in order) keeps
them in order; a bus outage costs the event's live delivery (logged), never the caller.
"""

from __future__ import annotations

import asyncio
import logging

from streamserver.bus import Bus
from streamserver.events import Event

log = logging.getLogger(__name__)


class OrderedPublisher:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._locks: dict[str, asyncio.Lock] = {}

    async def publish(self, event: Event) -> bool:
        """True when the bus took the event."""
        lock = self._locks.setdefault(event.room_id, asyncio.Lock())
        async with lock:
            try:
                await self.bus.publish(event.room_id, event.to_json(), keep=event.kept)
                return True
            except Exception:  # noqa: BLE001 - BusError, or a bug in a bus: the server goes on
                log.exception("could not publish %s to room %s", event.type, event.room_id)
                return False

    def forget(self, room_id: str) -> None:
        """The room is gone: drop its lock."""
        self._locks.pop(room_id, None)
