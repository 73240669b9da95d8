"""Pacing: a student's audio may arrive at most a little faster than real time.

A live microphone produces one second of audio per second. A client that sends much more is
broken or hostile, and queuing what it sends would let one link fill the recognition queue and
the server's memory for everyone. A token bucket allows `rate` x real time, with a burst of up
to `burst_s` seconds of audio (what a network stall delivers at once when it clears); audio past
it is refused, never queued. A new stream starts with `initial_s` only: a stall cannot have held
back more than the stream's own age, and a client that reconnects to flood again gets little.
"""

from __future__ import annotations

import time
from typing import Callable

from engines.features import SAMPLE_RATE

RATE = 1.5  # x real time
# What a stall lets through at once when it clears: a 3 s burst closes honest WebRTC students
# (benchmarks/README.md, "Figures behind choices in the code").
BURST_S = 10.0
INITIAL_S = 1.0


class TooFast(Exception):
    """The stream sends audio faster than it can be spoken (the message says how fast)."""


class Pacer:
    def __init__(self, rate: float = RATE, burst_s: float = BURST_S, clock: Callable[[], float] = time.monotonic,
                 on_refused: Callable[[], None] | None = None, initial_s: float = INITIAL_S) -> None:
        self.rate, self.capacity, self.clock, self.on_refused = rate, burst_s * SAMPLE_RATE, clock, on_refused
        self._allowance = min(initial_s, burst_s) * SAMPLE_RATE
        self._last = clock()
        self._started = self._last
        self._samples = 0

    def take(self, samples: int) -> None:
        """Count `samples` of 16 kHz audio; TooFast when they are over the allowance."""
        now = self.clock()
        self._allowance = min(self.capacity, self._allowance + (now - self._last) * self.rate * SAMPLE_RATE)
        self._last = now
        self._samples += samples
        if samples > self._allowance:
            if self.on_refused:
                self.on_refused()
            elapsed = max(now - self._started, 1e-3)
            raise TooFast(f"audio arrives at {self._samples / SAMPLE_RATE / elapsed:.1f}x real time; "
                          f"at most {self.rate:g}x is accepted")
        self._allowance -= samples
