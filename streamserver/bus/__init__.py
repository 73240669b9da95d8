"""Routing of room events: one interface, an in-process bus and a Redis bus.

publish() sends a JSON event to every subscriber of a room and appends it to the room's capped
history, so that a dashboard that reconnects can replay what it missed.

Seats: the per-room student limit holds for the whole room, whatever process seated each
student. A seat is held by leases (take_seat), renewed by the process that holds the student
(renew_seats) and ended on leave (release_seat) or, when that process died, by their expiry.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol


class Bus(Protocol):
    async def publish(self, room_id: str, event_json: str, keep: bool = True) -> None:
        """Deliver to current subscribers of the room and, if `keep`, append to its history
        (a live caption is not kept: a dashboard that joins later replays finals only)."""

    async def publish_many(self, room_id: str, events: list[tuple[str, bool]]) -> None:
        """Several events of one room (JSON, keep), in order, in one round trip."""

    def subscribe(self, room_id: str) -> AsyncIterator[str]:
        """Events of the room from now on, as JSON strings, until the iterator is closed."""

    async def history(self, room_id: str, limit: int = 200) -> list[str]:
        """The room's most recent events, oldest first."""

    async def transcript(self, room_id: str) -> list[str]:
        """Every final transcript of the room, in publish order: the whole class."""

    async def subscriber_count(self, room_id: str) -> int:
        """How many subscriptions of the room are live (a new one counts once it can receive)."""

    async def save_room(self, room_id: str, meta: dict[str, str], ttl_s: float) -> None:
        """Remember a room's record (name, language, limit; or that it is closed) where every
        process of the deployment can read it, replacing what was there, for ttl_s."""

    async def touch_room(self, room_id: str, ttl_s: float) -> None:
        """Keep the room's record for ttl_s from now (the room is in use)."""

    async def load_room(self, room_id: str) -> dict[str, str] | None:
        """What save_room stored, or None."""

    async def take_seat(self, room_id: str, student_id: str, limit: int, lease_s: float, holder: str,
                        name: str = "") -> bool:
        """A lease of lease_s on a seat for the student, held by `holder` (a process's id): True
        when the student already had a seat (a reconnect, through any process, keeps it) or the
        room had fewer than `limit` seats with a live lease; False when it is full. `name` (the
        student's display name) is kept with the seat, for seated()."""

    async def seated(self, room_id: str) -> dict[str, str]:
        """Every student with a live seat in the room, through any process: student -> name
        ("" when the seat was taken without one)."""

    async def seat_ids(self, room_id: str) -> set[str]:
        """The students of seated() without their names: a look that needs only who (a
        dashboard's feed, every few seconds), at a fifth of the cost in Redis."""

    async def seat_count(self, room_id: str) -> int:
        """How many seats of the room have a live lease: what a dashboard's feed looks at first,
        at a cost that does not grow with the room (it reads seat_ids() only when this has moved
        against what its dashboard was told: rooms/presence.py)."""

    async def renew_seats(self, seats: dict[str, dict[str, str]], lease_s: float, holder: str) -> None:
        """Extend holder's leases on its students' seats (room_id -> student id -> name) to lease_s
        from now; a seat that expired meanwhile is taken again with its name, even past the limit
        (the student is here: new students wait until the room is below it)."""

    async def release_seat(self, room_id: str, student_id: str, holder: str) -> None:
        """End holder's lease; the seat is free once no process holds the student any more."""

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


def create_bus(redis_url: str | None, history_len: int = 500, ca_file: str | None = None,
               transcript_retention_s: int | None = None, prefix: str | None = None) -> Bus:
    extra: dict[str, int | str] = {"transcript_retention_s": transcript_retention_s} if transcript_retention_s is not None else {}
    if redis_url:
        from streamserver.bus.redis import RedisBus

        if prefix is not None:
            extra["prefix"] = prefix
        return RedisBus(redis_url, history_len, ca_file=ca_file, **extra)
    from streamserver.bus.memory import MemoryBus

    return MemoryBus(history_len, **extra)
