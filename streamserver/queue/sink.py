"""Where a student's utterances go: the audio pipeline's end of the recognition queue, and the
answer to "can this class take one more student?". One class for every mode; the queue is
in-process (`serve`) or a Redis Stream (`gateway`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from streamserver.bus.ordered import OrderedPublisher
from streamserver.events import Utterance, UtteranceQueued
from streamserver.queue.base import UNREACHABLE, UtteranceQueue

log = logging.getLogger(__name__)
RETRY_FOR_S = 120.0  # the queue unreachable longer than this: the utterance is dropped, loudly


class Busy(RuntimeError):
    """The ASR workers cannot keep up: a new student would only make every class slower."""


class UtteranceSink:
    def __init__(self, queue: UtteranceQueue, publisher: OrderedPublisher, max_wait_s: float = 5.0) -> None:
        self.queue, self.publisher, self.max_wait_s = queue, publisher, max_wait_s
        self._tasks: set[asyncio.Task] = set()
        self._busy_checked = -1e9
        self._busy_reason: str | None = None
        self._busy_lock = asyncio.Lock()
        self.queued = 0
        self.dropped = 0

    async def stop(self) -> None:
        if self._tasks:  # utterances on their way to the queue: give them a moment
            await asyncio.wait(self._tasks, timeout=5)
        await self.queue.close()

    def submit(self, u: Utterance) -> None:
        """Called by the audio pipeline on the event loop; queuing happens in a task."""
        task = asyncio.get_running_loop().create_task(self._send(u))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, u: Utterance) -> None:
        deadline, delay = time.monotonic() + RETRY_FOR_S, 0.1
        while True:
            try:
                await self.queue.submit(u)
                break
            except UNREACHABLE as error:
                if time.monotonic() > deadline:
                    self.dropped += 1
                    log.error("utterance %s of room %s dropped: the queue was unreachable for %.0fs (%s)",
                              u.utterance_id, u.room_id, RETRY_FOR_S, error)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.queued += 1
        await self.publisher.publish(UtteranceQueued.of(u))  # a lost notice loses no speech

    async def depth(self) -> int:
        return await self.queue.depth()

    async def busy(self) -> str | None:
        """Why a new student should be turned away now, or None. Expected wait = jobs not yet
        published / the workers' summed throughput; checked at most once a second."""
        async with self._busy_lock:  # joins arriving together wait for one check, not skip it
            if time.monotonic() - self._busy_checked >= 1.0:
                self._busy_reason = await self._check_busy()
                self._busy_checked = time.monotonic()
        return self._busy_reason

    async def _check_busy(self) -> str | None:
        try:
            depth = await self.queue.depth()
            workers, rate = await self.queue.capacity()
        except UNREACHABLE as error:
            return f"the job queue is unreachable ({error})"
        if workers == 0:
            return "no ASR worker is running"
        if depth and rate <= 0:
            return None  # workers just started: no throughput measured yet
        wait = depth / rate if rate > 0 else 0.0
        return f"expected transcription wait {wait:.1f}s is over {self.max_wait_s:.1f}s" if wait > self.max_wait_s else None
