"""Finding a room: this process's own, or one another gateway of the deployment created.

A room is announced on the bus when it is created (name, language, student limit), so that any
gateway sharing the bus can seat its students and feed its teacher; the limit travels with the
record, and every gateway seats against the creator's.
"""

from __future__ import annotations

from streamserver.bus import Bus
from streamserver.rooms.registry import Room, RoomRegistry


class RoomDirectory:
    def __init__(self, rooms: RoomRegistry, bus: Bus) -> None:
        self.rooms, self.bus = rooms, bus

    async def create(self, name: str, language: str) -> Room:
        room = self.rooms.create(name, language)
        await self.bus.save_room(room.room_id, {"name": name, "language": language, "max_students": str(room.max_students)})
        return room

    async def find(self, room_id: str) -> Room | None:
        """Raises BusError when the bus cannot be asked."""
        room = self.rooms.get(room_id)
        if room is None and (meta := await self.bus.load_room(room_id)):
            limit = meta.get("max_students", "")
            room = self.rooms.adopt(
                room_id, meta.get("name", ""), meta.get("language", "auto"), int(limit) if limit.isdigit() else None
            )
        return room
