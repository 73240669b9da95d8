"""Publishing a room's events in the order they were made, as fast as the room makes them.

speaking_started and speaking_stopped are published from tasks made back to back, and two
publishes on a connection pool can overtake each other (a dashboard then shows a student
speaking who has stopped). So each room has one lane: its events wait in order, and one task
sends whatever waits as one batch (Bus.publish_many: one round trip to Redis), then the next.
A room's publishing then costs a round trip per batch, not per event: a lecture of thousands,
whose joins, speaking marks and transcripts come faster than one round trip each, sends them
as they come instead of queueing them behind each other. A bus outage costs the events' live
delivery (logged), never the caller.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from streamserver.bus import Bus
from streamserver.events import Event

log = logging.getLogger(__name__)
BATCH_MAX = 500  # events of one room in one round trip (a bounded pipeline: Redis answers each)


@dataclass
class _Lane:
    waiting: list[tuple[Event, asyncio.Future[bool]]] = field(default_factory=list)
    sender: asyncio.Task | None = None


class OrderedPublisher:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._lanes: dict[str, _Lane] = {}

    async def publish(self, event: Event) -> bool:
        """True when the bus took the event (it is sent with the room's others waiting now)."""
        lane = self._lanes.get(event.room_id)
        if lane is None:
            lane = self._lanes[event.room_id] = _Lane()
        taken: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        lane.waiting.append((event, taken))
        if lane.sender is None or lane.sender.done():
            lane.sender = asyncio.get_running_loop().create_task(self._send(event.room_id, lane))
        return await asyncio.shield(taken)  # a caller that gives up leaves the event in its place

    async def _send(self, room_id: str, lane: _Lane) -> None:
        while lane.waiting:
            batch, lane.waiting = lane.waiting[:BATCH_MAX], lane.waiting[BATCH_MAX:]
            try:
                await self.bus.publish_many(room_id, [(event.to_json(), event.kept) for event, _ in batch])
                taken = True
            except Exception:  # noqa: BLE001 - BusError, or a bug in a bus: the server goes on
                log.exception("could not publish %d events (%s, ...) to room %s", len(batch), batch[0][0].type, room_id)
                taken = False
            for _, future in batch:
                if not future.done():
                    future.set_result(taken)

    def forget(self, room_id: str) -> None:
        """The room is gone: drop its lane once it has sent what waits."""
        lane = self._lanes.get(room_id)
        if lane is not None and not lane.waiting:
            self._lanes.pop(room_id, None)
