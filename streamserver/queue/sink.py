"""The gateway's end of the job queue: where a student's utterances go when the engine runs in
worker processes, and the answer to "can this class take one more student?".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from redis.exceptions import RedisError

from streamserver.bus import Bus
from streamserver.events import Utterance, now
from streamserver.queue.redis_queue import JobQueue

log = logging.getLogger(__name__)
RETRY_FOR_S = 120.0  # Redis down longer than this: the utterance is dropped, loudly


class Busy(RuntimeError):
    """The ASR workers cannot keep up: a new student would only make every class slower."""


class QueueSink:
    def __init__(self, queue: JobQueue, bus: Bus, max_wait_s: float = 5.0) -> None:
        self.queue, self.bus, self.max_wait_s = queue, bus, max_wait_s
        self._tasks: set[asyncio.Task] = set()
        self._busy_checked = -1e9
        self._busy_reason: str | None = None
        self._busy_lock = asyncio.Lock()
        self.queued = 0
        self.dropped = 0

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        if self._tasks:  # utterances on their way to Redis: give them a moment
            await asyncio.wait(self._tasks, timeout=5)
        await self.queue.close()

    def submit(self, u: Utterance) -> None:
        task = asyncio.get_running_loop().create_task(self._send(u))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, u: Utterance) -> None:
        deadline, delay = time.monotonic() + RETRY_FOR_S, 0.1
        while True:
            try:
                await self.queue.submit(u)
                break
            except (RedisError, OSError) as error:
                if time.monotonic() > deadline:
                    self.dropped += 1
                    log.error("utterance %s of room %s dropped: redis unavailable for %.0fs (%s)",
                              u.utterance_id, u.room_id, RETRY_FOR_S, error)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.queued += 1
        # The room learns an utterance is on its way: dashboards (and the load simulator) can
        # tell a transcript that is late from one that was lost.
        event = {"type": "utterance_queued", "room_id": u.room_id, "utterance_id": u.utterance_id,
                 "student_id": u.student_id, "end_of_speech_ts": u.end_of_speech_ts, "ts": now()}
        try:
            await self.bus.publish(u.room_id, json.dumps(event))
        except Exception:  # noqa: BLE001 - the job is queued; only the notice is lost
            log.warning("could not announce utterance %s", u.utterance_id)

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
        except (RedisError, OSError) as error:
            return f"the job queue is unreachable ({error})"
        if workers == 0:
            return "no ASR worker is running"
        if depth and rate <= 0:
            return None  # workers just started: no throughput measured yet
        wait = depth / rate if rate > 0 else 0.0
        return f"expected transcription wait {wait:.1f}s is over {self.max_wait_s:.1f}s" if wait > self.max_wait_s else None
