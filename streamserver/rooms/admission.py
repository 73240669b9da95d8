"""Limits per client address that a student link can carry: seats held at once and joins per
minute. A student link is shared by a whole class, so the room's student limit alone lets one
machine holding the link take every seat; these limits bound what one address can take.

Counted by the process that seats the student (a gateway counts the students it holds); the
address is the TCP peer's, so behind a reverse proxy every student shares the proxy's: leave the
limits off there, or set them on the proxy.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class AddressLimits:
    seats_per_address: int | None = None
    joins_per_minute: int | None = None


class TooManyFromAddress(Exception):
    """The link's per-address limit is reached (the message says which)."""


class Admission:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._joins: dict[tuple[str, str], deque[float]] = {}

    def check(self, room_id: str, address: str, limits: AddressLimits, seats_held: int) -> None:
        """Count a join from `address` (holding `seats_held` seats of the room already), or refuse it."""
        if limits.seats_per_address is not None and seats_held >= limits.seats_per_address:
            raise TooManyFromAddress(f"this address already holds {seats_held} seats of the room "
                                     f"(the link allows {limits.seats_per_address})")
        if limits.joins_per_minute is None:
            return
        now = self.clock()
        joins = self._joins.setdefault((room_id, address), deque())
        while joins and joins[0] <= now - 60:
            joins.popleft()
        if len(joins) >= limits.joins_per_minute:
            raise TooManyFromAddress(f"more than {limits.joins_per_minute} joins a minute from this address")
        joins.append(now)

    def forget(self, room_id: str) -> None:
        for key in [k for k in self._joins if k[0] == room_id]:
            del self._joins[key]
