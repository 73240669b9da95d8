"""Fair share of the recognition queue: which waiting utterances go into the next batch, and
which one gives its place when a room's bound is reached.

Two levels: rooms, and inside a room the utterances' sources (Utterance.source: the client
address of the room's shared link, the link of a per-student one). Round robin over rooms, and
inside each room over its sources, oldest utterance first within a source. The turns carry over
from one batch to the next: the room (and the source) served longest ago goes first, so that with
batches of one utterance (a CPU) a room behind another's backlog still waits for one utterance,
not for the backlog. A link that floods its room gets one place per round like each other
source of the room, so its backlog delays itself, not its classmates or the class next door.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Callable, Mapping, TypeVar

T = TypeVar("T")
Share = tuple[str, str]  # (room, source)


class FairTurns:
    """Whose turn it is, kept from batch to batch (for the rooms and sources with work waiting)."""

    def __init__(self) -> None:
        self._served: dict[tuple[str, ...], int] = {}  # (room,) and (room, source) -> the turn last served
        self._turns = itertools.count()

    def batch(self, waiting: list[T], max_batch: int, share_of: Callable[[T], Share]) -> list[T]:
        """Remove and return up to max_batch items of `waiting` (kept in arrival order)."""
        rooms: dict[str, dict[str, deque[T]]] = {}
        for item in waiting:
            room, source = share_of(item)
            rooms.setdefault(room, {}).setdefault(source, deque()).append(item)
        batch: list[T] = []
        while len(batch) < max_batch and rooms:
            for room in sorted(rooms, key=lambda r: self._last((r,))):  # stable: never served, oldest first
                sources = rooms[room]
                source = min(sources, key=lambda s: self._last((room, s)))
                batch.append(sources[source].popleft())
                self._served[(room,)] = self._served[(room, source)] = next(self._turns)
                if not sources[source]:
                    del sources[source]
                if not sources:
                    del rooms[room]
                if len(batch) == max_batch:
                    break
        chosen = {id(item) for item in batch}
        waiting[:] = [item for item in waiting if id(item) not in chosen]
        # Only those with work left are remembered: one that comes back later has its turn first.
        left = {(room,) for room in rooms} | {(room, source) for room, sources in rooms.items() for source in sources}
        self._served = {key: turn for key, turn in self._served.items() if key in left}
        return batch

    def _last(self, key: tuple[str, ...]) -> int:
        return self._served.get(key, -1)


def entry_share(entry: tuple[str, object]) -> Share:
    """A queue entry's (entry id, Utterance) room and source."""
    u = entry[1]
    return u.room_id, u.source  # type: ignore[attr-defined]


def gives_way(held: Mapping[str, int], source: str) -> str | None:
    """At a room's bound: the source whose newest waiting utterance gives its place to one of
    `source` (`held`: the room's places per source). The source holding the most, if `source`
    holds fewer; None when `source` holds as many as any other (the newcomer is refused, as a
    class whose students all share one address is). The Redis queue's submit script keeps the
    same rule."""
    if not held:
        return None
    most = max(held, key=lambda s: held[s])
    return most if most != source and held.get(source, 0) < held[most] else None
