"""Per-room fair share: which waiting utterances go into the next batch.

Round robin over rooms, oldest utterance first within a room, rooms in the order of their
oldest waiting utterance. A room that floods the queue gets one place per round like every
other room, so its backlog delays itself, not the class next door.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, TypeVar

T = TypeVar("T")


def fair_batch(waiting: list[T], max_batch: int, room_of: Callable[[T], str]) -> list[T]:
    """Remove and return up to max_batch items of `waiting` (kept in arrival order)."""
    by_room: OrderedDict[str, list[T]] = OrderedDict()
    for item in waiting:
        by_room.setdefault(room_of(item), []).append(item)
    batch: list[T] = []
    while len(batch) < max_batch and by_room:
        for room in list(by_room):
            queue = by_room[room]
            batch.append(queue.pop(0))
            if not queue:
                del by_room[room]
            if len(batch) == max_batch:
                break
    chosen = {id(item) for item in batch}
    waiting[:] = [item for item in waiting if id(item) not in chosen]
    return batch
