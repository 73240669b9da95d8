"""Events for this process's own dashboards, beside the bus: an on-prem gateway's fallback
transcripts while its uplink (the central Redis) is down.

The bus carries every event to every process's dashboards; when the bus is unreachable, what the
gateway recognised itself would reach nobody. Each dashboard feed of this process also listens
here, and a feed that opens during the outage gets the room's recent local events as its
history. When the uplink returns the same transcripts reach the central history (and so the
bus); a feed shows a transcript once, whichever way it came first (rooms/feed.py).
"""

from __future__ import annotations

import asyncio
from collections import deque

from streamserver.events import TranscriptionSourceEvent

KEEP = 500  # recent local events per room, for feeds that open during an outage


class LocalFeeds:
    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self.central = True  # transcripts come from the central workers (False: this gateway's fallback)
        self._listeners: dict[str, set[asyncio.Queue[str | None]]] = {}
        self._recent: dict[str, deque[str]] = {}

    def publish(self, room_id: str, event_json: str) -> None:
        self._recent.setdefault(room_id, deque(maxlen=self._keep)).append(event_json)
        for queue in self._listeners.get(room_id, ()):
            queue.put_nowait(event_json)

    def listen(self, room_id: str, queue: asyncio.Queue[str | None]) -> None:
        self._listeners.setdefault(room_id, set()).add(queue)

    def unlisten(self, room_id: str, queue: asyncio.Queue[str | None]) -> None:
        listeners = self._listeners.get(room_id)
        if listeners is not None:
            listeners.discard(queue)
            if not listeners:
                del self._listeners[room_id]

    def uplink_changed(self, up: bool, room_ids: list[str]) -> None:
        """The fallback saw the uplink go or come back: every dashboard here is told (their
        header says where transcripts come from)."""
        self.central = up
        for room_id in room_ids:
            self.publish(room_id, TranscriptionSourceEvent(room_id, "central" if up else "local").to_json())

    def recent(self, room_id: str) -> list[str]:
        return list(self._recent.get(room_id, ()))

    def forget(self, room_id: str) -> None:
        self._recent.pop(room_id, None)
