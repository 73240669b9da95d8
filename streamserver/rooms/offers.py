"""How many WebRTC offers one client address, and one link, may make a minute.

Each accepted offer is a peer connection: its setup work, and STUN checks sent to the offer's
candidates (at most 10 candidates; about 60 packets, 5 KB, over 25 s). Offers are therefore
counted per client address and per link, each in a token bucket that holds a minute's worth and
refills at that rate: a school behind one NAT can seat that many WebRTC students a minute (and
the WebSocket ingest, which takes no offers, is not counted). A shared link counts its whole
class; a per-student link its one student.
"""

from __future__ import annotations

import time
from typing import Callable


class TooManyOffers(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _Buckets:
    """Token buckets by key, `per_minute` deep; a full one is forgotten (it holds nothing)."""

    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        self.per_minute, self.clock = per_minute, clock
        self._left: dict[str, tuple[float, float]] = {}  # key -> (tokens left, when counted)

    def take(self, key: str) -> float:
        """0 when the key may go on (and it is counted), else the seconds until it may."""
        now, rate = self.clock(), self.per_minute / 60
        left, at = self._left.get(key, (float(self.per_minute), now))
        left = min(float(self.per_minute), left + (now - at) * rate)
        if left < 1:
            return (1 - left) / rate
        self._left[key] = (left - 1, now)
        if len(self._left) > 10_000:  # forget the buckets that have refilled
            self._left = {k: (n, t) for k, (n, t) in self._left.items() if n + (now - t) * rate < self.per_minute}
        return 0.0


class OfferLimits:
    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute  # 0: not limited
        self._addresses = _Buckets(per_minute, clock)
        self._links = _Buckets(per_minute, clock)

    def check(self, address: str, link: str) -> None:
        """Count an offer from `address` with the link `link` (its token or its student), or
        TooManyOffers."""
        if not self.per_minute:
            return
        if wait := self._addresses.take(address):
            raise TooManyOffers(f"more than {self.per_minute} offers a minute from this address", wait)
        if wait := self._links.take(link):
            raise TooManyOffers(f"more than {self.per_minute} offers a minute with this link", wait)
