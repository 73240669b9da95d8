"""How far this process's event loop runs behind: the sign of an overloaded gateway.

Every student's audio is handled on the event loop (WebRTC packets, VAD, WebSocket frames). When
the loop falls behind, RTP packets wait in socket buffers, arrive late at the jitter buffer and
speech is lost without any error, so the lag is measured (a short sleep that wakes late), shown
in the metrics, logged when it is high, and new students are answered "busy" while it is.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)
TICK_S = 0.1
OVERLOADED_S = 0.25  # a lag past this loses WebRTC audio (aiortc's jitter buffer is ~a few hundred ms): warned
LATE_S = 0.1  # a tick this late ...
LATE_TICKS = 3  # ... on this many of the window's: a loop behind often enough to take no one more
WINDOW = 20  # ticks the "recent" lag looks back over (about 2 s)


class LoopLag:
    def __init__(self, on_sample=None) -> None:  # noqa: ANN001 - a callable(lag_s)
        self.on_sample = on_sample
        self.recent: list[float] = []
        self._warned_at = -1e9

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(TICK_S)
            self.record(max(0.0, time.perf_counter() - started - TICK_S))

    def record(self, lag: float) -> None:
        self.recent = (self.recent + [lag])[-WINDOW:]
        if self.on_sample:
            self.on_sample(lag)
        if lag > OVERLOADED_S and time.monotonic() - self._warned_at > 10:
            self._warned_at = time.monotonic()
            log.warning("overloaded: the event loop ran %.0f ms behind; students' audio may be delayed or lost", lag * 1000)

    def overloaded(self) -> str | None:
        """Why this process should take no new students now, or None: the loop ran LATE_S late
        on LATE_TICKS of the last WINDOW ticks. A loop that keeps up is on time on every tick
        (one hiccup, a garbage collection or a slow start, turns nobody away); one that is
        behind only now and then already delays what its students say and the acks they wait
        for, so the next students go elsewhere before its lag grows."""
        late = sum(1 for lag in self.recent if lag > LATE_S)
        if late >= LATE_TICKS:
            return (f"this gateway is overloaded (its event loop ran over {LATE_S * 1000:.0f} ms late on {late} "
                    f"of its last {len(self.recent)} ticks)")
        return None
