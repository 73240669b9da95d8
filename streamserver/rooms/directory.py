"""Finding a room: this process's own, or one another gateway of the deployment created.

A room is announced on the bus when it is created (name, language, student limit), so that any
gateway sharing the bus can seat its students and feed its teacher; the limit travels with the
record, and every gateway seats against the creator's. The record lives while the room is in
use and `idle_ttl_s` after (then the room is gone: 404). A closed room's record is replaced by a
tombstone that outlives its links, so that every link of it answers "closed" (403).
"""

from __future__ import annotations

from streamserver.bus import Bus
from streamserver.rooms.registry import Room, RoomRegistry

CLOSED = "closed"


class RoomClosed(Exception):
    """The room was closed by its teacher or an admin: its links no longer open the class (the
    teacher's still exports its transcript until it expires: api/app.py class_transcript)."""


class RoomDirectory:
    def __init__(self, rooms: RoomRegistry, bus: Bus, idle_ttl_s: float, link_ttl_s: float) -> None:
        self.rooms, self.bus, self.idle_ttl_s, self.link_ttl_s = rooms, bus, idle_ttl_s, link_ttl_s
        self.closed: set[str] = set()  # closed here (other processes read the tombstone)

    async def create(self, name: str, language: str, max_students: int | None = None) -> Room:
        room = self.rooms.create(name, language, max_students)
        try:
            await self.announce(room)
        except BaseException:  # a room whose record was never written is nobody's: its links would not open
            self.forget(room.room_id)
            raise
        return room

    async def announce(self, room: Room) -> None:
        """Write the room's record (again: a bus that lost it, a room made before the bus was up)."""
        record = {"name": room.name, "language": room.language, "max_students": str(room.max_students)}
        await self.bus.save_room(room.room_id, record, self.idle_ttl_s)

    async def find(self, room_id: str) -> Room | None:
        """Raises RoomClosed for a closed room, BusError when the bus cannot be asked."""
        if room_id in self.closed:
            raise RoomClosed("this room is closed")
        room = self.rooms.get(room_id)
        if room is not None:
            return room
        meta = await self.bus.load_room(room_id)
        if not meta:
            return None
        if meta.get(CLOSED):
            raise RoomClosed("this room is closed")
        limit = meta.get("max_students", "")
        return self.rooms.adopt(room_id, meta.get("name", ""), meta.get("language", "auto"), int(limit) if limit.isdigit() else None)

    async def is_open(self, room: Room) -> bool:
        """Whether the room's record still says open (another process may have closed it); a
        record gone missing (a bus that lost its data) is written again. Raises BusError."""
        meta = await self.bus.load_room(room.room_id)
        if not meta:
            await self.announce(room)
            return True
        return not meta.get(CLOSED)

    async def keep(self, room_id: str) -> None:
        """The room is in use: its record lives idle_ttl_s from now."""
        await self.bus.touch_room(room_id, self.idle_ttl_s)

    async def close(self, room_id: str) -> None:
        """Mark the room closed for every process, for as long as its links could be used."""
        self.closed.add(room_id)
        await self.bus.save_room(room_id, {CLOSED: "1"}, self.link_ttl_s)

    def forget(self, room_id: str) -> None:
        self.rooms.rooms.pop(room_id, None)
