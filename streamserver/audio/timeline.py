"""A student's own clock: where the audio the server got lies in what the student's page recorded.

A page that keeps its microphone audio (web_demo/student.js, the load simulator's students)
counts it in seconds since it started recording: the stream clock. It survives every reconnect of
the page, so the page and any server process can name the same audio across a break. The server
numbers the samples it feeds one student's VAD from 0; a run is a stretch of them that is
continuous on the stream clock (what a reconnect sent again, then the new live audio). Its start
is exact for audio sent with its time (catch-up, the WebSocket ingest), and estimated from the
page's marks ("my newest sample is at t") for live WebRTC audio, whose packets carry no such time:
off by the difference of two network paths, tens of milliseconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engines.features import SAMPLE_RATE

# What a clock's name may be (the page's and the simulator's are 16 hex digits).
CLOCK_NAME = re.compile(r"[A-Za-z0-9_-]{0,64}")


@dataclass
class Run:
    first_sample: int  # of the samples fed to the VAD
    start: float | None  # stream time of that sample; None until a mark places it


class StreamClock:
    def __init__(self) -> None:
        self._runs: list[Run] = []

    def add_run(self, first_sample: int, start: float | None) -> None:
        self._runs.append(Run(first_sample, start))

    def place(self, start: float) -> None:
        """Give the newest run its start, if it has none yet (the first mark decides)."""
        if self._runs and self._runs[-1].start is None:
            self._runs[-1].start = start

    def at(self, sample: int) -> float | None:
        """The stream time of a sample fed to the VAD; None when its run is not placed yet."""
        run = next((r for r in reversed(self._runs) if r.first_sample <= sample), None)
        if run is None or run.start is None:
            return None
        return run.start + (sample - run.first_sample) / SAMPLE_RATE

    def span(self, first_sample: int, samples: int) -> tuple[float, float] | None:
        start = self.at(first_sample)
        return None if start is None else (start, start + samples / SAMPLE_RATE)
