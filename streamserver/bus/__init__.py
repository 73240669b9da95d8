"""Routing of room events: one interface, an in-process bus and a Redis bus.

publish() sends a JSON event to every subscriber of a room and appends it to the room's capped
history, so that a dashboard that reconnects can replay what it missed.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol


class Bus(Protocol):
    async def publish(self, room_id: str, event_json: str) -> None:
        """Deliver to current subscribers of the room and append to its history."""

    def subscribe(self, room_id: str) -> AsyncIterator[str]:
        """Events of the room from now on, as JSON strings, until the iterator is closed."""

    async def history(self, room_id: str, limit: int = 200) -> list[str]:
        """The room's most recent events, oldest first."""

    async def subscriber_count(self, room_id: str) -> int:
        """How many subscriptions of the room are live (a new one counts once it can receive)."""

    async def save_room(self, room_id: str, meta: dict[str, str]) -> None:
        """Remember a room's name and language where every process of the deployment can read them."""

    async def load_room(self, room_id: str) -> dict[str, str] | None:
        """What save_room stored, or None."""

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


def create_bus(redis_url: str | None, history_len: int = 500) -> Bus:
    if redis_url:
        from streamserver.bus.redis import RedisBus

        return RedisBus(redis_url, history_len)
    from streamserver.bus.memory import MemoryBus

    return MemoryBus(history_len)
