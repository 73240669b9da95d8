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
OVERLOADED_S = 0.25  # a lag past this loses WebRTC audio (aiortc's jitter buffer is ~a few hundred ms)
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
        """Why this process should take no new students now, or None: the loop ran late on most
        of the last ticks (one hiccup, a garbage collection or a slow start, turns nobody away)."""
        late = sorted(self.recent)[len(self.recent) // 2] if len(self.recent) == WINDOW else 0.0
        if late > OVERLOADED_S:
            return f"this gateway is overloaded (its event loop runs {late * 1000:.0f} ms behind)"
        return None
