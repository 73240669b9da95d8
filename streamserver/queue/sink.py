"""Where a student's utterances go: the audio pipeline's end of the recognition queue, and the
answer to "can this class take one more student?". One class for every mode; the queue is
in-process (`serve`) or a Redis Stream (`gateway`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Protocol

from streamserver.audio.resample import RATE as SAMPLE_RATE
from streamserver.bus.ordered import OrderedPublisher
from streamserver.events import Utterance, UtteranceDropped, UtteranceQueued
from streamserver.metrics import Metrics
from streamserver.queue.base import UNREACHABLE, Displaced, HintWish, QueueFull, UtteranceQueue
from streamserver.queue.publication import final_from_speculation
from streamserver.queue.spool import Spool, SpoolError
from streamserver.tasks import Tasks

log = logging.getLogger(__name__)
RETRY_FOR_S = 120.0  # the queue unreachable longer than this: the utterance is dropped, loudly
FULL_HOLD_S = 10.0  # a room whose backlog reached its bound answers new students "busy" this long
SETTLED_REMEMBERED = 10_000


class Fallback(Protocol):
    """Recognition beside the queue (asr/fallback.py's LocalFallback)."""

    def now(self, u: Utterance) -> None: ...

    def watch(self, u: Utterance) -> None: ...

    def reachable(self) -> None: ...

    def taken(self, utterance_id: str) -> bool: ...

    def stored(self, utterance_id: str) -> bool: ...


class Busy(RuntimeError):
    """The ASR workers cannot keep up: a new student would only make every class slower."""


class UtteranceSink:
    def __init__(self, queue: UtteranceQueue, publisher: OrderedPublisher, metrics: Metrics, max_wait_s: float = 5.0,
                 spool: Spool | None = None, fallback: Fallback | None = None) -> None:
        self.queue, self.publisher, self.metrics, self.max_wait_s = queue, publisher, metrics, max_wait_s
        # With a spool, an utterance the queue cannot take is kept on disk (in order, through a
        # restart) instead of being retried in memory for RETRY_FOR_S and then dropped.
        self.spool = spool
        # With a fallback (asr/fallback.py), such an utterance is also recognised here at once,
        # and a queued one that no worker publishes in time.
        self.fallback = fallback
        self._drainer: asyncio.Task | None = None
        self._full: dict[str, float] = {}  # room ("" for the whole queue) -> monotonic time its bound was hit
        self._tasks = Tasks()
        self._busy: dict[str | None, tuple[float, str | None]] = {}  # room -> (checked at, reason)
        self._busy_lock = asyncio.Lock()
        self.queued = 0
        self.submitted = (0, 0.0)  # finals from the students here, and their seconds of audio (capacity.py)
        self.dropped = 0
        # (monotonic time checked, what the workers take: queue.hints_wanted)
        self._wanted: tuple[float, HintWish] = (-1e9, ("none", frozenset()))
        # Utterances settled without a publication: dropped (said to the room) or kept in the
        # spool; their audio needs no resending (settled()).
        self._settled: OrderedDict[str, None] = OrderedDict()

    def start(self) -> None:
        if self.spool is not None and self.spool.pending():  # left by a gateway that stopped
            self._drain()

    async def stop(self) -> None:
        await self._tasks.wait(5)  # utterances on their way to the queue: give them a moment
        if self._drainer is not None:
            self._drainer.cancel()
        await self.queue.close()

    def submit(self, u: Utterance) -> None:
        """Called by the audio pipeline on the event loop; queuing happens in a task."""
        finals, audio_s = self.submitted
        self.submitted = (finals + 1, audio_s + u.audio.size / SAMPLE_RATE)
        self._tasks.spawn(self._send(u))

    def hint(self, u: Utterance) -> None:
        """A partial or speculative utterance from the audio pipeline: offered once, best effort."""
        self._tasks.spawn(self._offer(u))

    async def settled(self, utterance_ids: list[str]) -> set[str]:
        """Those of the utterances that need their audio no more: published, or found to be a
        copy of a published one, or dropped, or spooled. UNREACHABLE errors when the queue is away."""
        done = await self.queue.done_of(utterance_ids) if utterance_ids else set()
        return done | {uid for uid in utterance_ids if uid in self._settled}

    def _settle(self, utterance_id: str) -> None:
        self._settled[utterance_id] = None
        if len(self._settled) > SETTLED_REMEMBERED:
            self._settled.popitem(last=False)

    async def _offer(self, u: Utterance) -> None:
        """Only what a worker would take now: an overloaded engine takes no hints, and sending
        them anyway would cost this process and the queue for nothing."""
        try:
            checked, wanted = self._wanted
            if time.monotonic() - checked >= 1.0:
                self._wanted = (time.monotonic(), wanted)  # one check a second, however many hints come
                wanted = await self.queue.hints_wanted()
                self._wanted = (time.monotonic(), wanted)
            level, skipped = wanted
            if level == "none" or (level == "speculative" and u.kind == "partial") or u.room_id in skipped:
                self.metrics.hints.labels(kind=u.kind, outcome="not_wanted").inc()
                return
            await self.queue.offer(u)
        except UNREACHABLE as error:  # a hint is never retried: the next one, or the final, follows
            log.debug("hint of utterance %s not offered: %s", u.utterance_id, error)
            self.metrics.hints.labels(kind=u.kind, outcome="unreachable").inc()
            return
        self.metrics.hints.labels(kind=u.kind, outcome="offered").inc()

    async def _speculated(self, u: Utterance) -> bool:
        """Publish the final from its speculative result, if one is ready for this very audio:
        the final then waits for no recognition at all."""
        try:
            event = await final_from_speculation(self.queue, u)
            if event is None:
                return False
            await self.publisher.publish(UtteranceQueued.of(u))
            if await self.queue.claim(event):
                self.metrics.utterances.labels(outcome=event.type).inc()
                self.metrics.eos_to_published.observe(max(0.0, event.published_ts - u.end_of_speech_ts))
            self.metrics.speculations.labels(outcome="used_at_end").inc()
            return True
        except (*UNREACHABLE, ConnectionError, ValueError, KeyError, TypeError) as error:
            log.warning("speculative result of utterance %s not used: %s", u.utterance_id, error)
            return False

    async def _send(self, u: Utterance) -> None:
        if self.fallback is not None:
            self.fallback.watch(u)
        if self._drainer is not None and not self._drainer.done():  # the spool goes first: order is kept
            await self._to_spool(u)
            return
        if await self._speculated(u):
            self.queued += 1
            return
        deadline, delay = time.monotonic() + RETRY_FOR_S, 0.1
        while True:
            try:
                displaced = await self.queue.submit(u)
                break
            except QueueFull as error:
                await self._refused(u, error)
                return
            except UNREACHABLE as error:
                if self.fallback is not None:
                    self.fallback.now(u)
                if self.spool is not None:
                    log.warning("queue unreachable (%s): utterance %s spooled", error, u.utterance_id)
                    await self._to_spool(u)
                    return
                if time.monotonic() > deadline:
                    self.dropped += 1
                    self._settle(u.utterance_id)
                    log.error("utterance %s of room %s dropped: the queue was unreachable for %.0fs (%s)",
                              u.utterance_id, u.room_id, RETRY_FOR_S, error)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        await self._queued(u, displaced)

    async def _queued(self, u: Utterance, displaced: Displaced | None) -> None:
        self.queued += 1
        if self.fallback is not None:
            self.fallback.reachable()
        await self.publisher.publish(UtteranceQueued.of(u))  # a lost notice loses no speech
        if displaced is not None:
            self._full[u.room_id] = time.monotonic()  # the room is at its bound
            await self._dropped(displaced, "it gave its place in the room's full queue to another link's utterance "
                                           "(the link holding the most of it gives way)")

    async def _to_spool(self, u: Utterance) -> None:
        assert self.spool is not None
        await asyncio.to_thread(self.spool.put, u)  # fsync: off the event loop
        self._settle(u.utterance_id)
        self.metrics.utterances.labels(outcome="spooled").inc()
        self._drain()

    def _drain(self) -> None:
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain_spool(), name="spool-drain")

    async def _drain_spool(self) -> None:
        """Queue the spooled utterances, oldest first, as soon as the queue takes them again."""
        assert self.spool is not None
        delay = 0.2
        while paths := await asyncio.to_thread(self.spool.pending):
            path = paths[0]
            try:
                u = await asyncio.to_thread(self.spool.load, path)
            except (SpoolError, OSError) as error:
                log.error("setting aside spool file %s: %s", path.name, error)
                await asyncio.to_thread(self.spool.set_aside, path)
                continue
            if self.fallback is not None and self.fallback.taken(u.utterance_id):
                if not self.fallback.stored(u.utterance_id):  # being recognised here: its result first
                    await asyncio.sleep(0.2)
                    continue
                await asyncio.to_thread(self.spool.remove, path)  # its result goes to the room, not the queue
                continue
            try:
                displaced = await self.queue.submit(u)
            except QueueFull as error:
                await self._refused(u, error)
            except UNREACHABLE:
                if self.fallback is not None:  # e.g. spooled by a gateway that restarted during the outage
                    await self._fall_back(paths)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            else:
                await self._queued(u, displaced)
            await asyncio.to_thread(self.spool.remove, path)
            delay = 0.2
        log.info("spool drained")

    async def _fall_back(self, paths: list) -> None:  # noqa: ANN001 - the spool's paths
        """Every spooled utterance the fallback has not taken: to the fallback."""
        assert self.spool is not None and self.fallback is not None
        for path in paths:
            if self.fallback.taken(self.spool.utterance_id(path)):
                continue
            try:
                self.fallback.now(await asyncio.to_thread(self.spool.load, path))
            except (SpoolError, OSError):
                continue  # the drain sets it aside

    async def _refused(self, u: Utterance, error: QueueFull) -> None:
        if error.scope != "student":  # one student's flood is its own; a room's bound makes the room busy
            self._full["" if error.scope == "total" else u.room_id] = time.monotonic()
        await self._dropped(u, str(error))

    async def _dropped(self, u: Utterance | Displaced, reason: str) -> None:
        self.dropped += 1
        self._settle(u.utterance_id)
        self.metrics.utterances.labels(outcome="dropped").inc()
        log.warning("utterance %s of student %s in room %s dropped: %s", u.utterance_id, u.student_id, u.room_id, reason)
        await self.publisher.publish(UtteranceDropped(u.room_id, u.utterance_id, u.student_id, u.end_of_speech_ts, reason))

    async def depth(self) -> int:
        return await self.queue.depth()

    async def watch_depth(self) -> None:
        """The queue's depth, as a gauge, every second."""
        while True:
            try:
                self.metrics.queue_depth.set(float(await self.depth()))
            except Exception:  # noqa: BLE001 - the queue is away: the gauge keeps its last value
                pass
            await asyncio.sleep(1.0)

    async def busy(self, room_id: str | None = None) -> str | None:
        """Why a new student (of `room_id`) should be turned away now, or None: the room's or the
        whole queue's bound was hit lately, or the expected wait = jobs not yet published / the
        workers' summed throughput is too long (checked at most once a second)."""
        now = time.monotonic()
        for key in ("", room_id):
            if key is not None and now - self._full.get(key, -1e9) < FULL_HOLD_S:
                return "the recognition queue of this room is full" if key else "the recognition queue is full"
        async with self._busy_lock:  # joins arriving together wait for one check, not skip it
            checked, reason = self._busy.get(room_id, (-1e9, None))
            if time.monotonic() - checked >= 1.0:
                reason = await self._check_busy(room_id)
                self._busy[room_id] = (time.monotonic(), reason)
        return reason

    async def _check_busy(self, room_id: str | None) -> str | None:
        """The expected wait of the room's next utterance. A fair queue serves rooms in turn, so
        it waits behind, of each room's backlog, at most as many as its own room has waiting
        plus one; a queue read in arrival order makes it wait behind everything."""
        try:
            backlog = await self.queue.backlog()
            depth = await self.queue.depth()
            workers, rate = await self.queue.capacity()
        except UNREACHABLE as error:
            return f"the job queue is unreachable ({error})"
        if workers == 0:
            return "no ASR worker is running"
        mine = backlog.get(room_id, 0) if room_id is not None else max(backlog.values(), default=0)
        ahead = sum(min(n, mine + 1) for n in backlog.values()) if self.queue.fair else depth
        if ahead and rate <= 0:
            return None  # workers just started: no throughput measured yet
        wait = ahead / rate if rate > 0 else 0.0
        return f"expected transcription wait {wait:.1f}s is over {self.max_wait_s:.1f}s" if wait > self.max_wait_s else None
