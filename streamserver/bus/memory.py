"""In-process bus: one asyncio event loop, no network (a single server process, and tests)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import AsyncIterator, Callable

from streamserver.bus.keys import TRANSCRIPT_RETENTION_S, is_final_transcript

log = logging.getLogger(__name__)
PRUNE_EVERY_S = 60.0  # old class transcripts are looked for at most this often

class MemoryBus:
    def __init__(self, history_len: int = 500, max_lag: int = 1000, transcript_retention_s: float = TRANSCRIPT_RETENTION_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rooms: dict[str, tuple[dict[str, str], float]] = {}  # room -> (record, monotonic expiry)
        self._history_len = history_len
        self._max_lag = max_lag
        self._history: dict[str, deque[str]] = {}
        self._subscribers: dict[str, set[asyncio.Queue[str | None]]] = {}
        self._seats: dict[str, dict[str, dict[str, float]]] = {}  # room -> student -> holder -> lease end
        self._seat_names: dict[str, dict[str, str]] = {}  # room -> student -> name, while seated
        # room -> its final transcripts, kept as the Redis bus keeps them: until the retention has
        # passed since the room's last final (then forgotten at the next final of any room)
        self._transcripts: dict[str, list[str]] = {}
        self._last_final: dict[str, float] = {}
        self._retention_s, self._clock = transcript_retention_s, clock
        self._next_prune = clock()
        self._closed = False

    async def publish_many(self, room_id: str, events: list[tuple[str, bool]]) -> None:
        for event_json, keep in events:
            await self.publish(room_id, event_json, keep)

    async def publish(self, room_id: str, event_json: str, keep: bool = True) -> None:
        history = self._history.get(room_id)
        if history is None:
            history = self._history[room_id] = deque(maxlen=self._history_len)
        if keep:
            history.append(event_json)
        if keep and is_final_transcript(event_json):  # the whole class, for the teacher's export
            self._forget_old_transcripts()
            self._transcripts.setdefault(room_id, []).append(event_json)
            self._last_final[room_id] = self._clock()
        # No await in here, so every subscriber sees events in publish order.
        for queue in list(self._subscribers.get(room_id, ())):
            try:
                queue.put_nowait(event_json)
            except asyncio.QueueFull:
                # A consumer this far behind (a stalled dashboard socket) would otherwise grow
                # memory without bound; it gets its stream ended and can reconnect + replay history.
                log.warning(
                    "room %s: subscriber more than %d events behind, disconnecting it",
                    room_id,
                    self._max_lag,
                )
                self._unregister(room_id, queue)
                _end(queue)

    async def subscribe(self, room_id: str) -> AsyncIterator[str]:
        """Events published from the first __anext__ on; ends on close() or when dropped for lag.

        Use `async with contextlib.aclosing(bus.subscribe(room))` so that leaving the loop
        unregisters at once rather than when the generator is garbage collected.
        """
        if self._closed:
            return
        queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=self._max_lag)
        self._subscribers.setdefault(room_id, set()).add(queue)
        try:
            while True:
                event = await queue.get()
                if event is None:  # put by _end(): closed, or dropped for lagging
                    return
                yield event
        finally:
            self._unregister(room_id, queue)

    async def save_room(self, room_id: str, meta: dict[str, str], ttl_s: float) -> None:
        self._rooms[room_id] = (dict(meta), time.monotonic() + ttl_s)

    async def touch_room(self, room_id: str, ttl_s: float) -> None:
        if (record := self._rooms.get(room_id)) is not None:
            self._rooms[room_id] = (record[0], time.monotonic() + ttl_s)

    async def load_room(self, room_id: str) -> dict[str, str] | None:
        record = self._rooms.get(room_id)
        if record is None or record[1] <= time.monotonic():
            self._rooms.pop(room_id, None)
            return None
        return record[0]

    def _live_seats(self, room_id: str) -> dict[str, dict[str, float]]:
        """The room's seats, student -> {holder: lease end}, expired leases dropped (monotonic
        clock); a student holds one seat while any holder's lease lasts."""
        now = time.monotonic()
        seats = self._seats.setdefault(room_id, {})
        names = self._seat_names.setdefault(room_id, {})
        for student_id, leases in list(seats.items()):
            if live := {holder: end for holder, end in leases.items() if end > now}:
                seats[student_id] = live
            else:
                del seats[student_id]
                names.pop(student_id, None)
        return seats

    async def take_seat(self, room_id: str, student_id: str, limit: int, lease_s: float, holder: str,
                        name: str = "") -> bool:
        seats = self._live_seats(room_id)
        if student_id not in seats and len(seats) >= limit:
            return False
        seats.setdefault(student_id, {})[holder] = time.monotonic() + lease_s
        if name:
            self._seat_names[room_id][student_id] = name
        return True

    async def seated(self, room_id: str) -> dict[str, str]:
        if room_id not in self._seats:
            return {}
        seats = self._live_seats(room_id)
        names = self._seat_names.get(room_id, {})
        return {student_id: names.get(student_id, "") for student_id in seats}

    async def seat_ids(self, room_id: str) -> set[str]:
        return set(self._live_seats(room_id)) if room_id in self._seats else set()

    async def seat_count(self, room_id: str) -> int:
        return len(self._live_seats(room_id)) if room_id in self._seats else 0

    async def renew_seats(self, seats: dict[str, dict[str, str]], lease_s: float, holder: str) -> None:
        end = time.monotonic() + lease_s
        for room_id, students in seats.items():
            live = self._live_seats(room_id)
            for student_id, name in students.items():
                if student_id not in live and name:  # taken again: its name went with its first seat
                    self._seat_names[room_id][student_id] = name
                live.setdefault(student_id, {})[holder] = end

    async def release_seat(self, room_id: str, student_id: str, holder: str) -> None:
        seats = self._live_seats(room_id)
        leases = seats.get(student_id, {})
        leases.pop(holder, None)
        if not leases:
            seats.pop(student_id, None)
            self._seat_names[room_id].pop(student_id, None)
        if not seats:
            del self._seats[room_id], self._seat_names[room_id]

    async def history(self, room_id: str, limit: int = 200) -> list[str]:
        history = self._history.get(room_id)
        if not history or limit <= 0:
            return []
        return list(history)[-limit:]

    async def transcript(self, room_id: str) -> list[str]:
        self._forget_old_transcripts()
        return list(self._transcripts.get(room_id, ()))

    def _forget_old_transcripts(self) -> None:
        now = self._clock()
        if now < self._next_prune:  # a walk over every room: not at every final
            return
        self._next_prune = now + min(PRUNE_EVERY_S, self._retention_s / 10)
        horizon = now - self._retention_s
        for room_id in [r for r, at in self._last_final.items() if at < horizon]:
            del self._transcripts[room_id], self._last_final[room_id]

    async def subscriber_count(self, room_id: str) -> int:
        """Live subscribers of the room (metrics, and tests waiting for a subscription)."""
        return len(self._subscribers.get(room_id, ()))

    async def ping(self) -> bool:
        return not self._closed

    async def close(self) -> None:
        self._closed = True
        for room_id, queues in list(self._subscribers.items()):
            for queue in list(queues):
                self._unregister(room_id, queue)
                _end(queue)

    def _unregister(self, room_id: str, queue: asyncio.Queue[str | None]) -> None:
        queues = self._subscribers.get(room_id)
        if queues is None:
            return
        queues.discard(queue)
        if not queues:  # rooms come and go: don't keep an empty set per room forever
            del self._subscribers[room_id]


def _end(queue: asyncio.Queue[str | None]) -> None:
    """Drop what the subscriber has not read yet (frees it now) and make its next get() end it."""
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(None)
