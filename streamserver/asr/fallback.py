"""An on-prem gateway's own recognition (`gateway --fallback-model`), for when the central
workers cannot transcribe its students: the uplink (the central Redis) is down, no worker is
alive, or an utterance has waited longer than --fallback-after.

    utterance -> UtteranceSink -> RedisQueue ---------------------------> central worker
                       |  unreachable / no worker / not done in time          |
                       v                                                      v
                 LocalFallback: recognised here -> claim (once per utterance) -> room history + bus
                                                  '-- uplink down: this gateway's dashboards
                                                      (LocalFeeds), written centrally later

Once per utterance: a local result goes to the room through the same guard as a worker's
(the utterance's done key, RedisQueue.claim), so whichever is first is the room's and the other
is not published; a dashboard shows a transcript once whichever way it came (api/app.py).
While the uplink is down the results go to this gateway's own dashboards at once and are kept
(in the spool, with --spool-dir: through a restart) until they can be claimed, oldest first.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Callable

from streamserver.asr.batch import BatchRecogniser
from streamserver.bus.local import LocalFeeds
from streamserver.config import Settings
from streamserver.events import TranscriptEvent, Utterance, now
from streamserver.metrics import Metrics
from streamserver.queue.base import UNREACHABLE
from streamserver.queue.redis_queue import RedisQueue
from streamserver.queue.spool import Spool, SpoolError
from streamserver.tasks import Tasks

log = logging.getLogger(__name__)
MAX_BATCH = 8  # utterances per local engine call: a gateway's CPU, not a GPU
SYNC_RETRY_MAX_S = 2.0
CHECK_S = 1.0  # a done-check unanswered this long: the uplink counts as down
CLAIM_S = 5.0
PROBE_S = 1.0


class LocalFallback:
    def __init__(self, recogniser: BatchRecogniser, queue: RedisQueue, local: LocalFeeds, metrics: Metrics,
                 after_s: float = Settings.fallback_after_s, spool: Spool | None = None) -> None:
        self.recogniser, self.queue, self.local, self.metrics = recogniser, queue, local, metrics
        self.after_s, self.spool = after_s, spool
        self.uplink_up = True  # as last seen: shown on this gateway's dashboards
        self.on_uplink: Callable[[bool], None] = lambda up: None
        self.recognised = 0  # utterances recognised here
        self._todo: asyncio.Queue[Utterance] = asyncio.Queue()
        self._taken: set[str] = set()  # utterance ids recognised here or on their way
        self._stored: set[str] = set()  # ... whose result is claimed or kept for the central history
        self._unsynced: list[str] = []  # results (event JSON) for the central history, without a spool
        self._tasks = Tasks()
        self._runner: asyncio.Task | None = None
        self._syncer: asyncio.Task | None = None
        self._prober: asyncio.Task | None = None

    def start(self) -> None:
        self._runner = asyncio.get_running_loop().create_task(self._run(), name="fallback")
        self._prober = asyncio.get_running_loop().create_task(self._probe(), name="fallback-probe")
        if self.spool is not None:
            for path in self.spool.results():  # left by a gateway that stopped during an outage
                self._taken.add(self.spool.utterance_id(path))
                self._stored.add(self.spool.utterance_id(path))
            if self.spool.results():
                self._sync()

    async def stop(self) -> None:
        for task in (self._runner, self._prober, self._syncer, *self._tasks):
            if task is not None:
                task.cancel()
        self.recogniser.close()

    # -- what the sink hands over --------------------------------------------------------------

    def now(self, u: Utterance) -> None:
        """The queue cannot take it (the uplink is down): recognised here at once."""
        self._set_uplink(False)
        self._take(u)

    def reachable(self) -> None:
        """The queue took an utterance: the uplink is up."""
        self._set_uplink(True)

    def watch(self, u: Utterance) -> None:
        """On its way to the queue: recognised here at once while the uplink is down, else if
        no worker is alive, or it is not published after_s after its end. A cut uplink often
        answers nothing (no reset): every check here has a deadline, not only Redis's timeouts."""
        if not self.uplink_up:
            self._take(u)
            return
        self._tasks.spawn(self._watch(u))

    def taken(self, utterance_id: str) -> bool:
        return utterance_id in self._taken

    def stored(self, utterance_id: str) -> bool:
        """Its result is the room's or kept durably for it: the utterance itself is not needed."""
        return utterance_id in self._stored

    async def _watch(self, u: Utterance) -> None:
        deadline = u.end_of_speech_ts + self.after_s
        try:
            workers, _rate = await asyncio.wait_for(self.queue.capacity(), max(0.1, deadline - now()))
            if workers:
                await asyncio.sleep(max(0.0, deadline - now()))
                if self.taken(u.utterance_id) or await asyncio.wait_for(self.queue.is_done(u.utterance_id), CHECK_S):
                    return
                log.warning("utterance %s not transcribed centrally %.0f s after its end: transcribing it here",
                            u.utterance_id, self.after_s)
            else:
                log.warning("no central worker is alive: transcribing utterance %s here", u.utterance_id)
        except (*UNREACHABLE, asyncio.TimeoutError):
            self._set_uplink(False)
        self._take(u)

    def _take(self, u: Utterance) -> None:
        if u.utterance_id not in self._taken:
            self._taken.add(u.utterance_id)
            self._todo.put_nowait(u)

    # -- recognition -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            batch = [await self._todo.get()]
            while len(batch) < MAX_BATCH and not self._todo.empty():
                batch.append(self._todo.get_nowait())
            for (_, u), event in await self.recogniser.run([("local", u) for u in batch]):
                if event is None:  # logged by the recogniser: the queue (or spool) still has it
                    self._taken.discard(u.utterance_id)
                    continue
                self.recognised += 1
                self.metrics.utterances.labels(outcome="fallback").inc()
                await self._deliver(replace(event, fallback=True))

    async def _deliver(self, event: TranscriptEvent) -> None:
        """To this gateway's dashboards at once; to the room (the claim) by the sync task, which
        may wait for the uplink: oldest first, kept durably meanwhile."""
        self.local.publish(event.room_id, event.to_json())
        if self.spool is not None:
            await asyncio.to_thread(self.spool.put_result, event.utterance_id, event.to_json())
        else:
            self._unsynced.append(event.to_json())
        self._stored.add(event.utterance_id)
        self._sync()

    # -- the central history, once the uplink is back ----------------------------------------------

    def _sync(self) -> None:
        if self._syncer is None or self._syncer.done():
            self._syncer = asyncio.get_running_loop().create_task(self._sync_all(), name="fallback-sync")

    async def _sync_all(self) -> None:
        delay = 0.2
        while True:
            if self.spool is not None:
                paths = await asyncio.to_thread(self.spool.results)
                if not paths:
                    return
                try:
                    event_json = await asyncio.to_thread(self.spool.load_result, paths[0])
                    event = TranscriptEvent.from_json(event_json)
                except (SpoolError, OSError, ValueError, TypeError, KeyError) as error:
                    log.error("setting aside fallback result %s: %s", paths[0].name, error)
                    await asyncio.to_thread(self.spool.set_aside, paths[0])
                    continue
            elif self._unsynced:
                event = TranscriptEvent.from_json(self._unsynced[0])
            else:
                return
            try:
                fresh = await asyncio.wait_for(self.queue.claim(event), CLAIM_S)
            except (*UNREACHABLE, asyncio.TimeoutError):
                self._set_uplink(False)
                await asyncio.sleep(delay)
                delay = min(delay * 2, SYNC_RETRY_MAX_S)
                continue
            self._set_uplink(True)
            log.info("fallback transcript of utterance %s %s the central history", event.utterance_id,
                     "written to" if fresh else "not needed in (a worker's is)")
            if self.spool is not None:
                await asyncio.to_thread(self.spool.remove, paths[0])
            else:
                self._unsynced.pop(0)
            delay = 0.2

    async def _probe(self) -> None:
        """While the uplink counts as down, ask Redis once a second whether it is back."""
        while True:
            await asyncio.sleep(PROBE_S)
            if not self.uplink_up:
                try:
                    await asyncio.wait_for(self.queue.depth(), CHECK_S)
                except (*UNREACHABLE, asyncio.TimeoutError):
                    continue
                self._set_uplink(True)

    def _set_uplink(self, up: bool) -> None:
        if up != self.uplink_up:
            self.uplink_up = up
            log.warning("uplink %s: transcripts from %s", "back" if up else "down",
                        "the central workers" if up else "this gateway's fallback model")
            self.on_uplink(up)
