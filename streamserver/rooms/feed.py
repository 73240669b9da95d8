"""A teacher's feed of one room (the dashboard's WebSocket): what the room said before it opened,
then what it says while it is open; each event once, and each utterance's result once.

Two sources: the bus (every process's events: a history of the last `history_len` and a live
subscription) and this process's own events (bus/local.py: an on-prem gateway's fallback
transcripts while its uplink is down). The subscription starts before the history is read, so
that nothing published in between is lost; what arrives both ways is sent once (Seen). Between
the history and the live events, the roster: every student seated in the room, whichever process
seated them (the seats on the bus keep their names). While the feed is open it looks at the seats
every third of a seat lease, for what a gateway that went quiet does not say (rooms/presence.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from streamserver.bus import Bus
from streamserver.bus.local import LocalFeeds
from streamserver.bus.redis import BusError
from streamserver.events import (RESULT_TYPES, StudentEvent, TranscriptionSourceEvent, TranscriptPartialEvent,
                                 event_type)
from streamserver.rooms.presence import JOINED, LEFT, Presence
from streamserver.rooms.registry import Room

log = logging.getLogger(__name__)
SUBSCRIBED_WAIT_S = 1.0  # how long the history waits for the subscription to be counted


class Seen:
    """What a feed has sent: an event once, and an utterance's result once, whichever way it
    came (the bus, its history, or this gateway's fallback: bus/local.py). Both memories are
    bounded, so that a feed open through a lecture of hours keeps the recent ones only: a copy
    comes within seconds of its original (the history replayed as the feed opens, a fallback's
    result reaching the central history after an outage)."""

    EVENTS_KEPT = 20_000  # the history replayed at the start is at most 500 of them
    RESULTS_KEPT = 200_000  # utterance ids

    def __init__(self) -> None:
        self._events: dict[str, None] = {}
        self._results: dict[str, None] = {}

    def first(self, event: str) -> bool:
        # Every event of the room passes here: its type costs a look at its first characters
        # (event_type), and only a partial or a result, whose utterance counts, is parsed.
        kind = event_type(event)
        if kind == TranscriptPartialEvent.type:  # live only (never replayed): not remembered
            return json.loads(event).get("utterance_id") not in self._results  # none after its final
        if event in self._events:
            return False
        _remember(self._events, event, self.EVENTS_KEPT)
        if kind in RESULT_TYPES:
            utterance_id = json.loads(event).get("utterance_id")
            if utterance_id in self._results:
                return False
            _remember(self._results, utterance_id, self.RESULTS_KEPT)
        return True


def _remember(kept: dict[str, None], key: str, most: int) -> None:
    kept[key] = None
    if len(kept) > most:
        del kept[next(iter(kept))]  # the oldest: a dict keeps insertion order


class DashboardFeed:
    """One dashboard's feed of a room, as an async context manager: `history()` once, `roster()`,
    then `live()` until the bus drops it or the dashboard goes. `open_feeds` counts the feeds open
    per room (rooms/upkeep.py keeps a watched room alive). With `fallback` (a gateway that
    transcribes on its own while its uplink is down) a bus that is away gives an empty history
    instead of an error."""

    def __init__(self, room_id: str, bus: Bus, local: LocalFeeds, open_feeds: dict[str, int], fallback: bool,
                 seat_lease_s: float = 30.0) -> None:
        self.room_id, self._bus, self._local, self._open, self._fallback = room_id, bus, local, open_feeds, fallback
        self._seen = Seen()
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._collecting: asyncio.Task | None = None
        self._seats_check_s = seat_lease_s / 3  # as often as a gateway renews its seats
        self._presence = Presence()
        self._told: set[str] = set()  # events the seat watch put in the queue (not the room's own)
        self._watching: asyncio.Task | None = None

    async def __aenter__(self) -> DashboardFeed:
        self._open[self.room_id] = self._open.get(self.room_id, 0) + 1
        self._local.listen(self.room_id, self._queue)
        self._collecting = asyncio.create_task(_collect(self._bus.subscribe(self.room_id), self._queue))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._open[self.room_id] -= 1
        self._local.unlisten(self.room_id, self._queue)
        tasks = [task for task in (self._collecting, self._watching) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def history(self) -> list[dict]:
        """The room's recent events, oldest first, as the dashboard replays them. Raises
        BusError when the bus is away (unless this gateway has its fallback)."""
        try:
            before = await self._bus.subscriber_count(self.room_id)
            for _ in range(int(SUBSCRIBED_WAIT_S / 0.01)):
                if await self._bus.subscriber_count(self.room_id) > before:
                    break
                await asyncio.sleep(0.01)
            history = await self._bus.history(self.room_id)
        except BusError:
            if not self._fallback:
                raise
            history = []  # the uplink is down: this gateway's own recent events, and the bus's when it returns
        history += self._local.recent(self.room_id)
        events = [json.loads(e) for e in history if self._seen.first(e)]
        if not self._local.central:
            events.append(TranscriptionSourceEvent(self.room_id, "local").to_dict())
        return events

    async def roster(self, room: Room) -> list[dict]:
        """Who is in the room now: every student seated through any process of the deployment
        (the seats on the bus), not only this one's, for a dashboard whose feed any process may
        serve. Whether a student speaks is known for this process's own students; another's say
        so with their next speaking event. With the bus away, this process's students."""
        try:
            seated = await self._bus.seated(room.room_id)
        except BusError:
            seated = {}
        here = {s["student_id"]: s for s in room.roster()}
        roster = []
        for student_id, name in seated.items():
            mine = here.pop(student_id, None)  # seated through this process: its name and speaking known here
            roster.append({"student_id": student_id, "student_name": name or (mine["student_name"] if mine else None),
                           "speaking": bool(mine and mine["speaking"])})
        roster += here.values()  # this process's students whose seat the bus does not list (yet, or it is away)
        self._presence.told(roster)
        if self._watching is None:
            self._watching = asyncio.create_task(self._watch_seats(room))
        return roster

    async def _watch_seats(self, room: Room) -> None:
        """Every third of a seat lease, a look at the room's seats; what it finds that the room did
        not say (a gateway that went quiet) goes to this dashboard (rooms/presence.py)."""
        while True:
            await asyncio.sleep(self._seats_check_s)
            self._presence.look_starts()
            try:
                if not self._presence.needs_seats(await self._bus.seat_count(room.room_id)):
                    continue
                seated = await self._bus.seat_ids(room.room_id)
            except BusError:
                continue  # the bus is away: the dashboard reconnects, or the next look finds it back
            except Exception:  # noqa: BLE001 - a bug of ours costs this look, never the feed
                log.exception("looking at the seats of room %s failed", room.room_id)
                continue
            for kind, student_id, name in self._presence.looked(seated, set(room.students)):
                event = StudentEvent(self.room_id, student_id, name, kind).to_json()
                self._told.add(event)
                self._queue.put_nowait(event)

    async def live(self) -> AsyncIterator[str]:
        """The room's events from now on, each once; it ends when the bus drops the subscription
        (the dashboard then reconnects and replays the history)."""
        while (event := await self._queue.get()) is not None:
            if self._seen.first(event):
                if event in self._told:
                    self._told.discard(event)
                elif (kind := event_type(event)) in (JOINED, LEFT):  # a few a second, even in a lecture
                    body = json.loads(event)
                    self._presence.noted(kind, body.get("student_id"), body.get("student_name") or "")
                yield event


async def _collect(events: AsyncIterator[str], queue: asyncio.Queue[str | None]) -> None:
    try:
        async for event in events:
            queue.put_nowait(event)
    finally:
        queue.put_nowait(None)
        await events.aclose()
