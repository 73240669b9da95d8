"""Seats: the per-room student limit, held as leases on the bus so that it counts the whole room,
whichever gateway seated each student.

This process holds (and renews) the seats of the students in its registry under one holder
name; a process that dies stops renewing, and its seats expire within a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

from streamserver.bus import Bus
from streamserver.rooms.registry import Room, RoomFull, RoomRegistry, Student

log = logging.getLogger(__name__)
# Seat releases in flight at once. A class that ends at once releases every seat of a gateway
# together, and each call in flight holds a Redis connection of its own: hundreds of students
# per gateway, times the gateways, pass Redis's client limit (10,000) and the releases beyond it
# fail (their seats then stay taken until their leases run out). In turn, they take a few ms.
RELEASES_IN_FLIGHT = 32


class SeatKeeper:
    def __init__(self, bus: Bus, rooms: RoomRegistry, lease_s: float) -> None:
        self.bus, self.rooms, self.lease_s = bus, rooms, lease_s
        self.holder = secrets.token_hex(8)
        self._task: asyncio.Task | None = None
        self._releasing = asyncio.Semaphore(RELEASES_IN_FLIGHT)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._renew(), name="seat-renewal")

    async def stop(self) -> None:
        """Stop renewing and free this process's seats now rather than when their leases run out."""
        if self._task:
            self._task.cancel()
        seated = [(room.room_id, s) for room in self.rooms.rooms.values() for s in room.students]
        if seated:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(self.free(r, s) for r, s in seated)), 5)

    async def take(self, room: Room, student_id: str, name: str = "") -> None:
        """A seat for the student (a reconnect, through any process, keeps its own), with the name
        every process's dashboards list it by: RoomFull when the room has none left; BusError
        when the bus fails."""
        if not await self.bus.take_seat(room.room_id, student_id, room.max_students, self.lease_s, self.holder, name):
            raise RoomFull(f"room is full ({room.max_students} students)")

    async def free(self, room_id: str, student_id: str) -> None:
        """Release a seat no longer renewed here; when the bus fails, its lease frees it."""
        try:
            async with self._releasing:
                await self.bus.release_seat(room_id, student_id, self.holder)
        except Exception as error:  # noqa: BLE001
            log.warning("seat of %s in room %s not released (%s): it expires with its lease", student_id, room_id, error)

    async def unseat(self, room: Room, student_id: str) -> Student | None:
        """The student leaves the room here and gives up the seat."""
        student = self.rooms.leave(room, student_id)
        await self.free(room.room_id, student_id)
        return student

    async def _renew(self) -> None:
        """Every third of a lease, extend the seats of the students seated here (one bus call for
        every room)."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            held = {room_id: {s.student_id: s.name for s in room.students.values()}
                    for room_id, room in self.rooms.rooms.items() if room.students}
            if not held:
                continue
            try:
                await self.bus.renew_seats(held, self.lease_s, self.holder)
            except Exception as error:  # noqa: BLE001 - the bus is away: try again next round
                log.warning("could not renew the seats of %d students (%s)", sum(map(len, held.values())), error)
                continue
            # A student who left while the renewal was on its way may have been released before
            # it arrived: release again, now that it has.
            for room_id, students in held.items():
                room = self.rooms.rooms.get(room_id)
                for student_id in students:
                    if room is None or student_id not in room.students:
                        await self.free(room_id, student_id)
