"""The rooms of this process over time: a room in use keeps its record alive and ends here when
another process closed it (or its record is gone); a room nobody used for the idle time is
forgotten; a closed room sends its students and dashboards away."""

from __future__ import annotations

import asyncio
import logging
import time

from streamserver.bus.ordered import OrderedPublisher
from streamserver.events import RoomClosedEvent
from streamserver.rooms.admission import Admission
from streamserver.rooms.connections import Connections
from streamserver.rooms.directory import RoomDirectory
from streamserver.rooms.registry import Room, RoomRegistry
from streamserver.rooms.seats import SeatKeeper
from streamserver.transport.ws_ingest import CLOSE_ROOM_CLOSED

log = logging.getLogger(__name__)
ROOM_WATCH_S = 2.0  # how soon a room closed through another process ends here
KEEP_EVERY_ROUNDS = 15  # a room in use renews its record every 30 s


class RoomUpkeep:
    def __init__(self, rooms: RoomRegistry, directory: RoomDirectory, seats: SeatKeeper, connections: Connections,
                 publisher: OrderedPublisher, admission: Admission, idle_ttl_s: float) -> None:
        self.rooms, self.directory, self.seats, self.connections = rooms, directory, seats, connections
        self.publisher, self.admission, self.idle_ttl_s = publisher, admission, idle_ttl_s
        self.feeds: dict[str, int] = {}  # room -> dashboards connected here
        self._last_used: dict[str, float] = {}  # room -> monotonic time it last had a student or a feed

    async def run(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(ROOM_WATCH_S)
            rounds += 1
            now = time.monotonic()
            for room in list(self.rooms.rooms.values()):
                in_use = room.students or self.feeds.get(room.room_id)
                if in_use:
                    self._last_used[room.room_id] = now
                elif now - self._last_used.setdefault(room.room_id, now) > self.idle_ttl_s:
                    self.forget(room.room_id)
                    continue
                try:
                    if in_use and rounds % KEEP_EVERY_ROUNDS == 0:
                        await self.directory.keep(room.room_id)
                    if in_use and not await self.directory.is_open(room):
                        await self.end_room(room, "the room was closed")
                except Exception as error:  # noqa: BLE001 - the bus is away: next round
                    log.warning("could not check room %s (%s)", room.room_id, error)

    async def close_room(self, room: Room) -> None:
        """Close the room for good, on every process: students and dashboards are sent away and
        its links answer 403. Raises BusError when the bus cannot record it."""
        await self.directory.close(room.room_id)
        await self.publisher.publish(RoomClosedEvent(room.room_id))
        await self.end_room(room, "the room was closed")

    async def end_room(self, room: Room, reason: str) -> None:
        self.directory.closed.add(room.room_id)
        for key, connection in self.connections.of_room(room.room_id):
            del self.connections[key]
            connection.audio.close()
            await connection.end(reason, CLOSE_ROOM_CLOSED)
        for student_id in list(room.students):
            await self.seats.unseat(room, student_id)
        self.forget(room.room_id)

    def forget(self, room_id: str) -> None:
        self.directory.forget(room_id)
        self.publisher.forget(room_id)
        self.admission.forget(room_id)
        self._last_used.pop(room_id, None)
