"""Admission before collapse: whether this gateway can seat one more student without slowing
down the students it has.

Three things fill up, each measured here:
- the event loop: its lag (loop_lag.py), and the CPU its thread spends per connected student, which
  says how many students the loop carries before it runs late (LOOP_SHARE of a core);
- recognition: the students connected on every gateway, each expected to send utterances at the
  larger of the measured rate and `expected_speaking` / the mean utterance length, against the
  workers' summed capacity (utterances/s each measures of itself); a class is planned at
  PLANNED_LOAD of the lowest capacity read over the last CAPACITY_WINDOW_S, so that bursts of
  speech queue for a fraction of a second, not for many. A worker's measure moves with the
  batches it happens to run (short utterances, cheap partials): planned on each reading, the
  students told busy and trying again would be seated on its highs and overload it on its lows;
- the queue's own signs (queue/sink.py busy): a bound reached, a long expected wait.
Joins are planned ahead because students join before they speak: a queue that is still empty
when a whole class joins says nothing about the load that class will bring a minute later.
A student already seated (a reconnect) is never refused: admission only decides who comes in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from streamserver.loop_lag import LoopLag
from streamserver.queue.base import UNREACHABLE
from streamserver.queue.sink import UtteranceSink

log = logging.getLogger(__name__)
BEAT_S = 1.0  # how often this gateway measures itself and tells the fleet its load
LOOP_SHARE = 0.7  # the loop's thread busy past this share of a core runs late under bursts
PLANNED_LOAD = 0.4  # recognition planned at this share of the workers' capacity (finals: hints take spare time)
MIN_STUDENTS = 50  # the loop's cost per student is measured over at least this many (a few streams' share is noise)
UTTERANCE_S = 5.0  # mean utterance length until this gateway has measured its own
SMOOTHING = 0.1  # of each beat's sample in the running means (about 10 s)
REFUSED_LOG_S = 5.0  # a gateway that refuses says why at most this often
CAPACITY_WINDOW_S = 30.0  # classes are planned on the workers' lowest capacity read over this long
FIRST_READ_S = 0.2  # until a measured worker is known, joins read the fleet themselves, at most this often


@dataclass
class Load:
    """What the fleet's gateways and workers say of themselves."""

    students: int = 0  # connected on every live gateway
    utterances_per_s: float = 0.0  # that they send for recognition
    capacity: float = 0.0  # utterances/s the live workers get through
    workers: int = 0


class Capacity:
    def __init__(self, sink: UtteranceSink, loop_lag: LoopLag, students: Callable[[], int],
                 expected_speaking: float, name: str) -> None:
        self.sink, self.loop_lag, self.students = sink, loop_lag, students
        self.expected_speaking, self.name = expected_speaking, name
        self.loop_cpu_per_student: float | None = None  # share of a core per connected student
        self.utterance_s = UTTERANCE_S
        self.fleet = Load()
        self._submitted = (0, 0.0)  # the sink's (finals, audio seconds) at the last beat
        self._rate = 0.0  # finals/s this gateway sends, smoothed
        self._told = 0  # the students this gateway counted in its last beat (in fleet.students)
        self._joins = 0  # students connected since the last beat
        self._refused_logged = -1e9
        self._capacities: deque[tuple[float, float, int]] = deque()  # (monotonic time, capacity, workers) of recent beats
        self._reading = asyncio.Lock()  # one read of the fleet for a wave of joins (_until_measured)
        self._read_at = -1e9
        self.stopped = False  # set before the task is cancelled (see run)

    async def run(self) -> None:
        """Beat until stopped. A cancellation that lands as redis-py's own timeout expires comes
        out of it as a TimeoutError (an OSError, so "unreachable") on Python 3.11: the loop
        then ends on `stopped`, or re-raises when its task is being cancelled, never beats on."""
        cpu, wall = time.thread_time(), time.monotonic()  # this coroutine runs on the loop's thread
        while not self.stopped:
            await asyncio.sleep(BEAT_S)
            cpu_now, wall_now = time.thread_time(), time.monotonic()
            self._measure((cpu_now - cpu) / max(wall_now - wall, 1e-3), wall_now - wall)
            cpu, wall = cpu_now, wall_now
            try:
                students = self.students()
                await self.sink.queue.gateway_beat(self.name, {"students": students, "utt_per_s": round(self._rate, 4)})
                await self._read_fleet()
                self._told = students
            except UNREACHABLE as error:  # the queue's own check says so to a join
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from error
                log.debug("fleet load not read: %s", error)

    def joined(self) -> None:
        """A student connected here (a join costs the loop far more than a second of its audio)."""
        self._joins += 1

    def _measure(self, loop_busy: float, seconds: float) -> None:
        """The loop's cost per student from a beat without a wave of joins: a class arriving
        costs the loop far more than it will once seated, and measured then it would turn the
        rest of the class away."""
        students, joins, self._joins = self.students(), self._joins, 0
        if students >= MIN_STUDENTS and joins <= max(2, students // 100):
            sample = loop_busy / students
            old = self.loop_cpu_per_student
            self.loop_cpu_per_student = sample if old is None else old + SMOOTHING * (sample - old)
        finals, audio_s = self.sink.submitted
        new_finals, new_audio = finals - self._submitted[0], audio_s - self._submitted[1]
        self._submitted = (finals, audio_s)
        self._rate += SMOOTHING * (new_finals / seconds - self._rate)
        if new_finals:
            self.utterance_s += SMOOTHING * (new_audio / new_finals - self.utterance_s)

    def _remember_capacity(self, fleet: Load, now: float) -> None:
        """Keep the window's readings; a fleet that lost a worker forgets the higher ones at once
        (the capacity it had is gone), one that gained a worker lets them age out."""
        if self._capacities and fleet.capacity < self._capacities[-1][1] and fleet.workers < self._capacities[-1][2]:
            self._capacities.clear()
        if fleet.workers and fleet.capacity > 0:  # none measured yet: the queue's own check answers
            self._capacities.append((now, fleet.capacity, fleet.workers))
        while self._capacities and self._capacities[0][0] < now - CAPACITY_WINDOW_S:
            self._capacities.popleft()

    def planned_capacity(self) -> float:
        """Utterances/s the workers are counted on for: the lowest recent reading."""
        return min((c for _, c, _ in self._capacities), default=self.fleet.capacity)

    def per_student(self) -> float:
        """Utterances/s a student is planned to send: the measured rate, never below the expected."""
        expected = self.expected_speaking / max(self.utterance_s, 0.5)
        measured = self.fleet.utterances_per_s / self.fleet.students if self.fleet.students >= MIN_STUDENTS else 0.0
        return max(expected, measured)

    def loop_full(self, adding: int = 1) -> str | None:
        """Why this process's event loop should take no more students, or None."""
        if reason := self.loop_lag.overloaded():
            return reason
        per = self.loop_cpu_per_student
        if per is not None and per * (self.students() + adding) > LOOP_SHARE:
            return f"this gateway is at its capacity (about {int(LOOP_SHARE / per)} students)"
        return None

    def recognition_full(self, adding: int = 1) -> str | None:
        """Why the workers should be planned no more students, or None (no worker measured yet:
        the queue's own check answers)."""
        fleet = self.fleet
        capacity = self.planned_capacity()
        if fleet.workers == 0 or capacity <= 0:
            return None
        students = max(0, fleet.students - self._told) + self.students() + adding
        planned = students * self.per_student()
        if planned > PLANNED_LOAD * capacity:
            return (f"transcription is at its capacity: {students} students would send about {planned:.1f} "
                    f"utterances/s; the workers take {capacity:.1f}")
        return None

    async def _until_measured(self) -> None:
        """Before a beat has read a measured worker (the first second of a gateway, or a fleet
        whose workers are still calibrating), a join reads the fleet itself: a class arriving
        then would otherwise find recognition unplanned and be seated whole."""
        if self._capacities:
            return
        async with self._reading:  # a read on its way counts for the joins that wait for it
            if self._capacities or time.monotonic() - self._read_at < FIRST_READ_S:
                return
            self._read_at = time.monotonic()
            with contextlib.suppress(*UNREACHABLE):  # the queue's own check says so
                await self._read_fleet()

    async def _read_fleet(self) -> None:
        self.fleet = Load(*await self.sink.queue.fleet_load())
        self._remember_capacity(self.fleet, time.monotonic())

    async def refuse(self, room_id: str | None, adding: int = 1) -> str | None:
        """Why a new student (of `room_id`) should be turned away now, or None."""
        await self._until_measured()
        reason = self.loop_full(adding) or self.recognition_full(adding) or await self.sink.busy(room_id)
        if reason and adding and time.monotonic() - self._refused_logged > REFUSED_LOG_S:
            self._refused_logged = time.monotonic()
            log.info("new students are answered busy: %s (%d connected here)", reason, self.students())
        return reason
