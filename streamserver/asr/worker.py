"""The ASR worker's loop, the same in `serve` (in-process queue) and `streamserver worker`
(Redis Stream): jobs -> per-room fair batches -> BatchRecogniser -> each result published and
its job acknowledged in one step (queue.complete).

Batching policy: whatever is queued when the engine becomes free goes in the next batch (up to
max_batch, and no more than the engine gets through in `batch_budget_s` at its measured rate).
Nothing waits for a batch to fill: under light load an utterance is recognised alone at once;
under load, batches grow by themselves while the engine is busy. The time budget bounds how
long a batch holds the engine: an utterance of another room that arrives behind a backlog waits
for the running batch and its own, each about a budget long. On a CPU, where the encoder runs
one utterance at a time, the budget is one utterance: a batch there saves a fraction of the
engine's time, but holds each of its finals until its last row is done, and the next room's
utterance waits for the whole running batch; rows also take twice as long while the host's cores
carry a busy gateway (benchmarks/README.md, "100 parallel paced streams of one link"). The queue
unreachable pauses the loop, which retries with backoff; a finished result whose publication
failed is retried, never dropped.

Hints (live captions and speculative finals) fill the engine's spare time and never delay a
final by more than one small batch: they are taken only when no final waits, in batches of about
HINT_BUDGET_S of engine time. A speculative result is kept for its final, which then needs no
recognition (the sink, or this loop, publishes it), and shown as the newest caption while
captions are on; a partial's text goes to the room at once.
`partials`: "on", "off" (speculative hints only) or "auto" (partials while the finals and
speculations kept the engine busy less than HEADROOM of the last BUSY_WINDOW_S and no final
waited in the queue more than FINAL_WAIT_S in it; no hints at all past HEADROOM, on "off" too:
an overloaded engine spends itself on finals). Where another row in a batch costs little (a GPU:
engine.batch_rows_cheap), hints also ride in the finals' batches: speculative ones always, and
partials while the engine has headroom (busy < HEADROOM; "on": always) -- under load the queue
always holds finals, and hints taken only between batches would come too late. A final whose
speculation another worker is recognising waits for it (PENDING_S at most) rather than being
recognised twice.
Where one room keeps a CPU engine busy on its own (a flood on its link: the rest would leave the
engine headroom), the gateways offer none of its hints, and the other rooms' speculative hints
and finals take their turns (FairTurns) before its finals: a room's speculation is its own work,
and without it each of its finals waits out the hangover, then the running row of the busy room,
then its own recognition.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter, OrderedDict, deque
from contextlib import contextmanager, suppress
from typing import Awaitable, Coroutine, Iterator

from engines.engine import Engine
from engines.features import SAMPLE_RATE
from streamserver.asr.batch import BatchRecogniser
from streamserver.result_log import log_result
from streamserver.capacity import UTTERANCE_S
from streamserver.config import PARTIAL_MODES, Settings
from streamserver.events import (QuestionGroupEvent, TranscriptEvent, TranscriptPartialEvent, Utterance,
                                 UtteranceFailedEvent, now)
from streamserver.intent import ASKING, IntentClassifier
from streamserver.intent.groups import RoomGroups
from streamserver.metrics import Metrics
from streamserver.queue.base import HINT_MAX_AGE_S, MAX_ATTEMPTS, UNREACHABLE, Entry, Speculation, UtteranceQueue, queued_at
from streamserver.queue.publication import Completion, complete_all, finals_from_speculations
from streamserver.queue.fair import FairTurns, entry_share

log = logging.getLogger(__name__)
HEARTBEAT_S = 0.25  # also how often dead workers' jobs are looked for
BATCH_BUDGET_S = 1.0
SLOW_BATCH_S = 0.25  # a GPU batch that takes longer is logged with what it held: finals wait behind it
HINT_BUDGET_S = 0.1  # a batch of hints holds the engine about this long: a final arriving waits that
HINT_POLL_MS = 20  # with hints wanted, how long a read waits for a final before looking at them
DEFERRED_POLL_MS = 10  # with finals waiting for another worker's speculation, how often they are looked at
BUSY_WINDOW_S = 5.0
GROUPED_KEPT = 10_000  # utterances remembered as filed in their question group (_group_questions)
RECENT_FINALS = 256
HEADROOM = 0.7
WARM_WORDS = (3, 10, 20, 40, 80)  # text lengths whose label shapes a GPU worker's calibration meets
# auto: a final that waited longer than this in the queue (the engine was not free: on a CPU box
# the hints' work also takes the cores from the gateway and the other workers) stops the partials
# for BUSY_WINDOW_S
FINAL_WAIT_S = 0.5
# auto: captions only while the engine was busy, captions included, less than this share of the
# window: a final that ends while a caption is being recognised waits for it, so the engine keeps
# half its time free for finals
CAPTIONS_SHARE = 0.5


async def cancel_for_sure(task: asyncio.Task) -> None:
    """Cancel until it is done: on Python 3.11 a cancellation that lands as an asyncio.timeout()
    expires is turned into a TimeoutError (redis-py reads under one), and the loop would go on."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    if not task.cancelled() and task.exception() is not None:
        log.debug("worker task ended with %r", task.exception())


Result = tuple[Entry, TranscriptEvent | None]


def by_student(results: list[Result]) -> list[list[Result]]:
    """The results in lanes, one a student, each in the order spoken: a batch's captions go
    side by side (side_by_side), one student's in order, so that the worker is not held a round
    trip to the queue per caption."""
    lanes: dict[str, list[Result]] = {}
    for result in results:
        u = result[0][1]
        lanes.setdefault(f"{u.room_id}/{u.student_id}", []).append(result)
    return list(lanes.values())


async def side_by_side(lanes: list[Awaitable[None]]) -> None:
    """Every lane run to its end; the first error raised once all are over."""
    errors = [e for e in await asyncio.gather(*lanes, return_exceptions=True) if e is not None]
    if errors:
        raise errors[0]


class AsrWorker:
    # A worker process logs the results it publishes; in `serve` the room feed's publisher does
    # (result_log.py), for those served from a speculation too.
    log_results = False

    def __init__(
        self, engine: Engine, queue: UtteranceQueue, intent: IntentClassifier | None = None,
        max_batch: int = Settings.max_batch, metrics: Metrics | None = None, partials: str = Settings.partials,
    ) -> None:
        if partials not in PARTIAL_MODES:
            raise ValueError(f"partials must be one of {', '.join(PARTIAL_MODES)}, not {partials!r}")
        self.engine, self.queue, self.max_batch, self.partials = engine, queue, max_batch, partials
        self.batch_budget_s = BATCH_BUDGET_S if engine.batch_rows_cheap else 0.0  # a CPU: one utterance a batch
        self.metrics = metrics or Metrics()
        self.recogniser = BatchRecogniser(engine, intent, self.metrics)
        self.buffer: list[Entry] = []
        self._turns = FairTurns()  # whose turn it is in the buffer (a Redis worker's read holds several rooms')
        self._in_progress: set[str] = set()
        # The publications of recognised batches, one after the other (each awaits the one before:
        # one student's finals in the order spoken); the engine meanwhile recognises the next batch.
        self._publishing: asyncio.Task[None] | None = None
        self._publishing_ids: set[str] = set()  # their jobs: not to be claimed back from ourselves
        self._rate = 0.0  # utterances/s, smoothed: what backpressure reads
        self._batch_rows = 1.0  # rows a batch, smoothed: how far the rate is from a full batch's (capacity)
        self.ready = False  # engine loaded and measured, queue reachable: /readyz
        self._calibrated = False
        self.transcribed = 0
        self._task: asyncio.Task | None = None
        self._busy: deque[tuple[float, float, bool]] = deque()  # (start, end, essential) of recent engine work
        self._room_busy: deque[tuple[float, str, float]] = deque()  # (end, room, seconds) of the essential work
        # The utterances of the finals recognised last (RECENT_FINALS): their speculations, until
        # the publication is done, are not worth a recognition (_in_turn)
        self._recent_finals: OrderedDict[str, None] = OrderedDict()
        self._waited = -1e9  # monotonic time a final last waited more than FINAL_WAIT_S in the queue
        self._hints_waiting = False  # the last look found hints: look again without waiting
        # Finals whose speculation another worker is recognising: they wait for it (PENDING_S at
        # most) instead of being recognised twice.
        self._deferred: dict[str, Entry] = {}
        # Hints taken as riders whose language no final of the batch had: each language is an
        # engine call of its own, so they wait here for a batch of theirs or the next pass
        # between batches (the newest of each utterance; in this process only, as hints are).
        self._held_hints: dict[str, Utterance] = {}
        # The questions and help requests this worker published, grouped per room by what they
        # ask (intent/groups.py); each group's id starts with groups_id, this worker's (its queue
        # name) and this process's, so that no two workers' or runs' groups share an id.
        self.groups = RoomGroups()
        self._grouped: OrderedDict[str, None] = OrderedDict()  # the utterances filed, the newest GROUPED_KEPT
        self.groups_id = f"{getattr(queue, 'worker', None) or 'serve'}.{secrets.token_hex(3)}"

    def start(self) -> None:
        """Run in the background of this process's event loop (`serve`)."""
        self._task = asyncio.get_running_loop().create_task(self.run(), name="asr-worker")

    async def stop(self) -> None:
        if self._task:
            await cancel_for_sure(self._task)

    async def run(self) -> None:
        await self._until_reachable(self.queue.ensure_group)
        tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._claims())]
        try:
            await self._calibrate()
            self.ready = self._calibrated = True
            await self._loop()
        finally:
            for t in tasks:
                t.cancel()
            if self._publishing is not None:  # its jobs stay pending: claimed, published once
                self._publishing.cancel()
            self.recogniser.close()

    async def _until_reachable(self, op, *args):  # noqa: ANN001, ANN202 - any queue coroutine
        delay = 0.1
        while True:
            try:
                return await op(*args)
            except UNREACHABLE as error:
                self.ready = False
                log.warning("queue unavailable (%s); retrying in %.1fs", error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _calibrate(self) -> None:
        """Real speech through the whole recognition (engine and intent labels) before any
        student counts on it: on an engine whose rows cost little (a GPU), a batch of each size
        up to max_batch, so that no class's first batches pay for kernels loaded or shapes
        planned at their first use; on a CPU one utterance. The last batch's time is the first
        measure of this worker's capacity, on which admission plans classes (capacity.py) until
        real batches refine it."""
        from engines.audio import load_audio
        from streamserver.loadsim.scenario import CLIPS_DIR

        sizes = [1]
        while self.engine.batch_rows_cheap and sizes[-1] < self.max_batch:
            sizes.append(min(2 * sizes[-1], self.max_batch))
        recogniser = self.recogniser.uncounted()
        try:
            speech = [load_audio(path) for path in sorted(CLIPS_DIR.glob("*.wav"))]
            for rows in sizes:
                batch = [(f"calibration-{i}", Utterance(f"calibration-{i}", "", "", "", "en", speech[i % len(speech)], 0.0, 0.0))
                         for i in range(rows)]
                started = time.perf_counter()
                await recogniser.run(batch)
                seconds = time.perf_counter() - started
                for words in WARM_WORDS if self.engine.batch_rows_cheap else ():
                    await recogniser.warm_labels(rows, words)  # the texts' other lengths
        except Exception:  # noqa: BLE001 - no first measure: the queue's own checks admit until batches measure it
            log.exception("the recognition's capacity was not measured")
            return
        finally:
            recogniser.close()
        self._batch_rows = float(sizes[-1])
        self._rate = sizes[-1] / max(seconds, 1e-3)
        if not self.engine.batch_rows_cheap:
            # On a CPU an utterance costs about its length, and admission counts students in
            # utterances of UTTERANCE_S until a gateway has measured its own: a shorter clip's rate
            # would seat a class its real utterances then overload.
            audio_s = sum(u.audio.size for _, u in batch) / SAMPLE_RATE
            self._rate *= audio_s / (sizes[-1] * UTTERANCE_S)
        log.info("recognition capacity: about %.1f utterances/s (%d rows in %.3f s)", self.capacity(), sizes[-1], seconds)

    def capacity(self) -> float:
        """Utterances/s this worker gets through when busy: its measured rate, and on an engine
        whose extra rows cost little (a GPU), scaled from the batches it ran to full ones."""
        if not self.engine.batch_rows_cheap:
            return self._rate
        return self._rate * self.max_batch / max(self._batch_rows, 1.0)

    async def _heartbeats(self) -> None:
        while True:
            try:
                await self.queue.heartbeat(self.heartbeat_stats())
                self.metrics.queue_depth.set(await self.queue.depth())
                self.ready = self._calibrated
            except UNREACHABLE:
                self.ready = False
            await asyncio.sleep(HEARTBEAT_S)

    def heartbeat_stats(self) -> dict[str, float | int | str]:
        """What the queue's readers see of this worker: its rate and capacity (admission), the
        jobs it holds, the hints it takes, and the room whose hints it does not
        (busiest_room; only while it takes no hints otherwise)."""
        return {"utt_per_s": round(self._rate, 2), "capacity": round(self.capacity(), 2), "buffer": len(self.buffer),
                "hints": self.hints_taken(), "hints_except": (self.hint_kinds() is None and self.busiest_room()) or ""}

    async def _claims(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                claimed = await self.queue.claim_orphans()
            except UNREACHABLE:
                continue
            known = {eid for eid, _ in self.buffer} | self._in_progress | self._publishing_ids | self._deferred.keys()
            self.buffer += [e for e in claimed if e[0] not in known]

    async def _loop(self) -> None:
        while True:
            if self._deferred:
                with self._step("deferred"):
                    await self._settle_deferred()
            size = self.batch_size()  # once: a read and the batch it feeds agree
            hints = self.hint_kinds()
            busiest = None if hints is not None else self.busiest_room()
            if not self.buffer:
                # Read only once the buffer is empty: jobs this worker holds but has not started
                # are the ones that wait for a claim if it dies, so it asks for what its next
                # batch will use (a cluster's streams, read side by side, may bring more: the
                # queue keeps those for the next read).
                block_ms = 200 if hints is None and busiest is None else 0 if self._hints_waiting else HINT_POLL_MS
                if self._deferred:
                    block_ms = min(block_ms, DEFERRED_POLL_MS)
                try:
                    with self._step("read"):
                        self.buffer += await self.queue.read(size, block_ms)
                except UNREACHABLE as error:
                    self.ready = False
                    log.warning("queue unavailable (%s)", error)
                    await asyncio.sleep(0.5)
                    continue
            elif busiest is not None and all(u.room_id == busiest for _, u in self.buffer):
                # Another room's final that came meanwhile goes before the busiest room's (_in_turn):
                # one look, without waiting; its speculation may be ready for it by now. The one
                # read-ahead: a job of the busiest room may wait here a row longer.
                with suppress(*UNREACHABLE):
                    self.buffer += await self.queue.read(size, 0)
            if not self.buffer and busiest is None:
                if hints is not None:  # partials too while they would ride (a GPU with headroom)
                    with self._step("hints"):
                        await self._take_hints(hints or self.partial_riders())
                else:
                    self._hints_waiting = False
                continue
            if busiest is None:
                batch = self._turns.batch(self.buffer, size, entry_share)
            else:
                with self._step("hints"):
                    batch = await self._in_turn(busiest, size)
                if not batch:
                    continue
                if not batch[0][0]:  # speculations: their rooms' turn
                    with self._step("hints"):
                        await self._speculate(batch)
                    continue
            self._in_progress = {eid for eid, _ in batch}  # not to be claimed back from ourselves
            self._recent_finals.update((u.utterance_id, None) for _, u in batch)
            while len(self._recent_finals) > RECENT_FINALS:
                self._recent_finals.popitem(last=False)
            try:
                await self._recognised(batch)  # its publication goes on beside the next batch
            finally:
                # A job left pending (its recognition failed) may be claimed again, by us too.
                self._in_progress = set()

    def batch_size(self) -> int:
        """max_batch, or fewer when the engine would take longer than the budget over them."""
        if self._rate <= 0:
            return self.max_batch
        return max(1, min(self.max_batch, int(self._rate * self.batch_budget_s)))

    def hint_kinds(self) -> bool | None:
        """None: no hints now; else whether partials are taken too (or speculative hints only)."""
        if self.partials == "on":
            return True
        busy = self.busy_ratio()
        self.metrics.engine_busy.set(round(busy, 3))
        if busy >= HEADROOM:
            return None
        return (self.partials == "auto" and time.monotonic() - self._waited > BUSY_WINDOW_S
                and self.busy_ratio(with_partials=True) < CAPTIONS_SHARE)

    def partial_riders(self) -> bool:
        """Whether partials ride in the finals' batches too (_riders): where a row costs little
        (engine.batch_rows_cheap), while the finals and speculations leave the engine headroom
        ("on": always). They then wait for no final and delay none by more than their rows."""
        if not self.engine.batch_rows_cheap or self.partials == "off":
            return False
        return self.partials == "on" or self.busy_ratio() < HEADROOM

    def hints_taken(self) -> str:
        """What the gateways should offer this worker (queue.base.HINT_LEVELS): speculative hints
        always where they ride along in batches (_riders), partials too while they ride."""
        kinds = self.hint_kinds()
        if kinds or self.partial_riders():
            return "all"
        if kinds is None:
            return "speculative" if self.engine.batch_rows_cheap or self.busiest_room() is not None else "none"
        return "speculative"

    def busiest_room(self) -> str | None:
        """On a CPU (one row a batch), the room whose work alone keeps the engine busy: past
        HEADROOM of the last BUSY_WINDOW_S, while the other rooms' work would leave it headroom.
        The other rooms' speculations then take turns with the finals (_in_turn); on an engine
        busy with many rooms' work, none does: the finals have it all."""
        if self.engine.batch_rows_cheap:
            return None
        busy = self.busy_ratio()
        if busy < HEADROOM:
            return None
        horizon = time.monotonic() - BUSY_WINDOW_S
        while self._room_busy and self._room_busy[0][0] < horizon:
            self._room_busy.popleft()
        by_room: Counter[str] = Counter()
        for end, room, seconds in self._room_busy:
            by_room[room] += min(seconds, end - horizon)  # as busy_ratio, the window's part
        if not by_room:
            return None
        room, seconds = by_room.most_common(1)[0]
        return room if busy - seconds / BUSY_WINDOW_S < HEADROOM else None

    async def _in_turn(self, busiest: str, size: int) -> list[Entry]:
        """The next batch where one room keeps the engine busy (busiest_room): the other rooms'
        finals in the buffer and their waiting speculative hints first, in their turns
        (FairTurns), then the busiest room's finals; the buffer holds one final at a time here,
        so the turns cannot see that room's backlog, and it had the engine for most of the
        window. Speculations chosen come back marked (_speculating); the hints not chosen are
        held for the next look."""
        try:
            # All there are: the gateways stop offering the busiest room's within a second, but
            # those offered before wait ahead of the others'. The busiest room's are dropped (best
            # effort, as hints are), also where another worker would have taken them.
            hints = await self.queue.take_hints(self.max_batch, partials=False)
        except UNREACHABLE:
            hints = []
        self._hints_waiting = False  # all taken: the next look waits for a final as usual
        # Not one whose final is here already: the final takes its turn, and its recognition
        # makes the speculation pointless.
        finals = {u.utterance_id for _, u in [*self.buffer, *self._deferred.values()]} | self._recent_finals.keys()
        hints = [h for h in await self._with_held(hints, False) if h.room_id != busiest and h.utterance_id not in finals]
        others = [entry for entry in self.buffer if entry[1].room_id != busiest] + [("", h) for h in hints]
        if not others:
            return self._turns.batch(self.buffer, size, entry_share)
        chosen = self._turns.batch(others, size, entry_share)
        taken = {id(entry) for entry in chosen}
        self._hold([entry[1] for entry in others if not entry[0] and id(entry) not in taken])
        self.buffer = [entry for entry in self.buffer if id(entry) not in taken]
        speculations = [u for entry_id, u in chosen if not entry_id]
        if not speculations:
            return chosen
        self.buffer = [entry for entry in chosen if entry[0]] + self.buffer
        return await self._speculating(speculations)

    def busy_ratio(self, with_partials: bool = False) -> float:
        """Share of the last BUSY_WINDOW_S the engine spent on finals and speculations (and
        partials, `with_partials`)."""
        horizon = time.monotonic() - BUSY_WINDOW_S
        while self._busy and self._busy[0][1] < horizon:
            self._busy.popleft()
        return sum(end - max(start, horizon) for start, end, essential in self._busy
                   if essential or with_partials) / BUSY_WINDOW_S

    def hint_batch_size(self) -> int:
        """As many hints as the engine gets through in HINT_BUDGET_S at full batches (capacity()):
        where rows are cheap (a GPU), the rate of recent passes is low when they were small, and
        a size taken from it would keep them small on a busy host."""
        if self._rate <= 0:
            return min(self.max_batch, 2)
        return max(1, min(self.max_batch, int(self.capacity() * HINT_BUDGET_S)))

    async def _transcribe(self, batch: list[Entry]) -> None:
        """Recognise a batch and publish its results (and any before them)."""
        publication = await self._recognised(batch)
        if publication is not None:
            await publication

    async def _recognised(self, batch: list[Entry]) -> asyncio.Task[None] | None:
        """Recognise a batch; its publication is started behind the batches' before it and
        returned, not awaited: the loop reads and recognises the next batch meanwhile, so that
        the engine does not wait on Redis's round trips. It waits for the publication before it
        only once it has a new one to start: at most one batch's publication is in flight."""
        now = time.time()
        if any(now - at > FINAL_WAIT_S for entry_id, _ in batch if (at := queued_at(entry_id)) is not None):
            self._waited = time.monotonic()
        with self._step("speculations"):
            batch, waiting = await self._from_speculations(batch)
        self._deferred.update((entry[0], entry) for entry in waiting)
        if not batch:
            return self._publishing
        with self._step("riders"):
            riders = await self._riders(batch)
        started = time.perf_counter()
        # The labels in line: labelling beside the next engine batch (a thread of its own) takes
        # more of a saturated host's cores and makes every final later. The riders' results are
        # kept before the finals are published: a speculation is of use only before its hangover
        # ends, a final is late already (figures in benchmarks/README.md, "Figures behind choices
        # in the code").
        with self._step("recognition"):
            results = await self.recogniser.run(batch + riders)
        self._worked(started, batch + riders)
        if self._publishing is not None and not self._publishing.done():
            with self._step("publication_wait"):
                await asyncio.wait({self._publishing})
        if self._publishing is not None and self._publishing.done() and not self._publishing.cancelled() \
                and (error := self._publishing.exception()) is not None:
            raise error
        return self._chain(self._timed("publication", self._publish_batch(results)), batch)

    @contextmanager
    def _step(self, step: str) -> Iterator[None]:
        """The time of a step of the loop, awaits included (streamserver_worker_seconds_total)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.metrics.worker_seconds.labels(step=step).inc(time.perf_counter() - started)

    async def _timed(self, step: str, work: Awaitable[None]) -> None:
        with self._step(step):
            await work

    def _chain(self, publication: Coroutine[None, None, None], entries: list[Entry]) -> asyncio.Task[None]:
        """`publication` run once the publications started before it are over."""
        previous, ids = self._publishing, {entry_id for entry_id, _ in entries}
        self._publishing_ids |= ids

        async def after() -> None:
            try:
                if previous is not None:
                    await asyncio.wait({previous})
                await publication
            finally:
                self._publishing_ids -= ids

        self._publishing = asyncio.get_running_loop().create_task(after())
        return self._publishing

    async def _publish_batch(self, results: list[Result]) -> None:
        captions = await self._keep_speculations([r for r in results if r[0][1].kind == "speculative"])
        await self._finish([r for r in results if r[0][1].kind == "final"])
        # Captions last: a final never waits for a caption's round trip to Redis.
        await self._publish_partials(captions + [r for r in results if r[0][1].kind == "partial"])

    async def _riders(self, batch: list[Entry]) -> list[Entry]:
        """Hints to recognise in the finals' batch, where another row costs little
        (engine.batch_rows_cheap: a GPU): speculative ones, and partials while partial_riders().
        Under load the queue always holds finals, so hints taken only between batches would wait
        behind them (a speculation until its hangover ends, of no use then; a caption for
        seconds); riding along, each is recognised within one batch, and a speculation's final
        then needs no recognition at all."""
        room = self.max_batch - len(batch)
        if not self.engine.batch_rows_cheap or room <= 0:
            return []
        partials = self.partial_riders()
        try:
            hints = await self.queue.take_hints(room, partials=partials)
        except UNREACHABLE:
            return []
        # Only those of the batch's languages (another language is an engine call of its own:
        # held for later), and not a final's own hint: a speculation dropped unmarked, its final
        # is recognised as always; a caption of an utterance whose final is here would come after it.
        languages, finals = {u.language for _, u in batch}, {u.utterance_id for _, u in batch}
        hints = [h for h in await self._with_held(hints, partials) if h.utterance_id not in finals]
        riding = [h for h in hints if h.language in languages][:room]
        taken = {id(h) for h in riding}
        self._hold([h for h in hints if id(h) not in taken])
        return await self._speculating(riding) + [("", u) for u in riding if u.kind == "partial"]

    def _hold(self, hints: list[Utterance]) -> None:
        """Hints to recognise later (the holding is empty: _with_held took it): the newest
        speech, max_batch of them at most; the oldest is the least worth and the nearest to its
        age limit."""
        newest = sorted(hints, key=lambda h: h.end_of_speech_ts, reverse=True)[: self.max_batch]
        self._held_hints = {h.utterance_id: h for h in newest}

    async def _with_held(self, hints: list[Utterance], partials: bool) -> list[Utterance]:
        """`hints` and the held ones, taken out of holding: the newest revision of each utterance,
        none whose final is published meanwhile or older than the queue's HINT_MAX_AGE_S,
        partials only if `partials`; in the queue's order, speculative ones first (each saves its
        final a recognition), then the oldest speech."""
        held, self._held_hints = self._held_hints, {}
        if held:
            try:
                done = await self.queue.done_of(list(held))
            except UNREACHABLE:
                done = set(held)  # not known now: best effort, as hints are
            held = {uid: h for uid, h in held.items() if uid not in done}
        newest: dict[str, Utterance] = {}
        for h in [*held.values(), *hints]:
            if h.utterance_id not in newest or h.revision >= newest[h.utterance_id].revision:
                newest[h.utterance_id] = h
        fresh = [h for h in newest.values()
                 if now() - h.end_of_speech_ts <= HINT_MAX_AGE_S and (partials or h.kind == "speculative")]
        return sorted(fresh, key=lambda h: (h.kind != "speculative", h.end_of_speech_ts))

    async def _speculating(self, hints: list[Utterance]) -> list[Entry]:
        """Speculative hints about to be recognised, marked so: their finals, if they come
        meanwhile, wait for these instead of a second recognition."""
        speculative = [("", u) for u in hints if u.kind == "speculative"]
        if speculative:
            try:
                await self.queue.keep_speculations({u.utterance_id: Speculation.in_progress(u.digest) for _, u in speculative})
            except UNREACHABLE:
                pass
        return speculative

    async def _keep_speculations(self, results: list[tuple[Entry, TranscriptEvent | None]]) -> list[tuple[Entry, TranscriptEvent | None]]:
        """Each result kept for its final; a failed one's mark is lifted (its final is then
        recognised at once, not after PENDING_S). Returned: the results that are their
        utterance's newest caption (the utterance as it stands at its pause, unless its final
        comes first), for the caller to publish once any finals are out."""
        done = {u.utterance_id: Speculation(u.digest, event.to_json()) for (_, u), event in results if event is not None}
        failed = {u.utterance_id: Speculation(u.digest, "") for (_, u), event in results if event is None}
        try:
            await self.queue.keep_speculations({**done, **failed})
        except UNREACHABLE:
            return []
        self.metrics.speculations.labels(outcome="recognised").inc(len(done))
        # Filed now: its final may be published by the gateway from this result (never seen here).
        await self._group_questions([event for _, event in results if event is not None])
        if self.partials == "off":  # no extra work: recognised anyway, but captions are off
            return []
        return [r for r in results if r[1] is not None and r[1].text]

    def _worked(self, started: float, entries: list[Entry], essential: bool = True) -> None:
        """The engine's time on `entries`, in the busy window; the rate (capacity, what admission
        plans classes on) moves only with essential work, the finals and speculations: a pass of
        captions alone is spare time's work, and on a CPU its shorter window runs about three
        times the rows a second that finals do (engines/policy.py, CAPTION_WINDOWS), so counted
        it would seat classes that the finals then overload."""
        seconds = time.perf_counter() - started
        end = time.monotonic()
        if essential:
            self._rate = 0.8 * self._rate + 0.2 * (len(entries) / max(seconds, 1e-3))
            self._batch_rows = 0.8 * self._batch_rows + 0.2 * len(entries)
            for room, rows in Counter(u.room_id for _, u in entries).items():
                self._room_busy.append((end, room, seconds * rows / len(entries)))
            while self._room_busy and self._room_busy[0][0] < end - BUSY_WINDOW_S:
                self._room_busy.popleft()
        self._busy.append((end - seconds, end, essential))
        if seconds > SLOW_BATCH_S:  # on a CPU every utterance costs about that: said at debug level there
            kinds = Counter(u.kind for _, u in entries)
            spent = self.recogniser.last_seconds
            log.log(logging.INFO if self.engine.batch_rows_cheap else logging.DEBUG,
                    "slow batch: %d finals, %d speculations, %d partials took %.2f s (engine %.2f s, labels %.2f s; "
                    "the oldest ended %.2f s ago)", kinds["final"], kinds["speculative"], kinds["partial"], seconds,
                    spent.get("engine", 0.0), spent.get("intent", 0.0),
                    time.time() - min(u.end_of_speech_ts for _, u in entries))

    async def _from_speculations(self, batch: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        """Finals whose speculative result is ready are published from it (queue/publication.py);
        returned: the rest to recognise, and those whose speculation another worker is
        recognising (to wait for)."""
        ready, rest, waiting = await finals_from_speculations(self.queue, batch)
        self.metrics.speculations.labels(outcome="used_by_worker").inc(len(ready))
        if ready:
            self._chain(self._finish(list(ready)), [entry for entry, _ in ready])
        return rest, waiting

    async def _settle_deferred(self) -> None:
        """The finals waiting for a speculation: published from it once it is ready; recognised
        here if it is not coming (its worker gave up or died: the mark's time passed)."""
        settled = len(self._deferred)
        rest, waiting = await self._from_speculations(list(self._deferred.values()))  # still theirs meanwhile (claims)
        if len(rest) + len(waiting) < settled and self._publishing is not None:
            await self._publishing  # those published from their speculation: out before the loop goes on
        self._deferred = {entry[0]: entry for entry in waiting}
        self.buffer += rest
        self.metrics.speculations.labels(outcome="waited_for_in_vain").inc(len(rest))

    async def _take_hints(self, partials: bool) -> None:
        size = self.hint_batch_size()  # a final arriving meanwhile waits for this pass
        try:
            hints = await self.queue.take_hints(size, partials)
        except UNREACHABLE:
            hints = []
        hints = await self._with_held(hints, partials)
        self._hold(hints[size:])
        hints = hints[:size]
        self._hints_waiting = bool(hints)
        speculative = await self._speculating(hints)
        if speculative:
            await self._speculate(speculative)
        partial = [("", u) for u in hints if u.kind == "partial"]
        if partial:
            started = time.perf_counter()
            results = await self.recogniser.run(partial)
            self._worked(started, partial, essential=False)
            await self._publish_partials(results)

    async def _speculate(self, speculative: list[Entry]) -> None:
        """Speculations marked (_speculating) recognised, kept for their finals, shown as captions."""
        started = time.perf_counter()
        results = await self.recogniser.run(speculative)
        self._worked(started, speculative)
        await self._publish_partials(await self._keep_speculations(results))

    async def _publish_partials(self, results: list[Result]) -> None:
        shown = [r for r in results if r[1] is not None and r[1].text]
        await side_by_side([self._publish_partials_in_order(lane) for lane in by_student(shown)])

    async def _publish_partials_in_order(self, lane: list[Result]) -> None:
        for (_, u), event in lane:
            assert event is not None
            try:
                sent = await self.queue.publish_partial(TranscriptPartialEvent.of(u, event.text, event.language))
            except UNREACHABLE:
                continue
            self.metrics.partials.labels(outcome="published" if sent else "late").inc()

    async def _finish(self, results: list[Result]) -> None:
        """A batch's finals published, or their failures counted: a job whose recognition failed
        stays pending and is delivered again (claim_orphans) until MAX_ATTEMPTS, then its failure
        is published."""
        failed = [entry for entry, event in results if event is None]
        given_up: set[str] = set()
        if failed:
            counts = await asyncio.gather(*(self._until_reachable(self.queue.attempt, entry_id) for entry_id, _ in failed))
            for (entry_id, u), count in zip(failed, counts):
                if count >= MAX_ATTEMPTS:
                    log.error("giving up utterance %s after %d attempts", u.utterance_id, MAX_ATTEMPTS)
                    given_up.add(entry_id)
        done: list[Completion] = []
        for (entry_id, u), event in results:
            if event is not None:
                done.append((entry_id, u, event))
            elif entry_id in given_up:
                done.append((entry_id, u, UtteranceFailedEvent.of(u)))
        await self._complete(done)

    async def _complete(self, done: list[Completion]) -> None:
        """Published once each (queue.complete_many: a round trip per Redis primary, not per
        final), those the queue could not take completed again until it does."""
        delay = 0.1
        grouped: list[TranscriptEvent] = []
        while done:
            replies = await complete_all(self.queue, done)
            for (_, u, event), fresh in zip(done, replies):
                if fresh is None:
                    continue
                self.transcribed += 1
                if fresh:
                    if self.log_results:
                        log_result(event)
                    self.metrics.utterances.labels(outcome=event.type).inc()
                    self.metrics.eos_to_published.observe(max(0.0, event.published_ts - u.end_of_speech_ts))
                    grouped.append(event)
                else:
                    self.metrics.utterances.labels(outcome="duplicate_suppressed").inc()
            done = [completion for completion, fresh in zip(done, replies) if fresh is None]
            if done:
                self.ready = False
                log.warning("%d results not published yet; again in %.1fs", len(done), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        await self._group_questions(grouped)

    async def _group_questions(self, events: list[TranscriptEvent]) -> None:
        """Questions (and help requests) filed in their rooms' groups, by the e5 vector each label
        was read from, and each group they grew sent to its room once, as it stands after them;
        once per utterance, from whichever this worker labelled first: its speculative result
        (the utterance at its pause: its final may be published from it by the gateway, unseen
        here) or its final. Best effort: a group the bus did not take is sent again as it stands
        when it next grows."""
        grown: dict[tuple[str, str], QuestionGroupEvent] = {}
        for event in events:
            if event.type != TranscriptEvent.type or (event.intent or {}).get("label") not in ASKING:
                continue
            if event.utterance_id in self._grouped:
                continue
            self._grouped[event.utterance_id] = None
            if len(self._grouped) > GROUPED_KEPT:
                self._grouped.popitem(last=False)
            try:
                vector = await self.recogniser.vector_of(event.text)
                if vector is None:
                    continue
                group = self.groups.of(event.room_id).add(event.utterance_id, event.student_id, event.text, vector,
                                                          event.published_ts, event.language)
                fields = group.to_dict()
                fields["group_id"] = f"{self.groups_id}:{group.group_id}"
                grown[(event.room_id, fields["group_id"])] = QuestionGroupEvent(event.room_id, **fields)
            except Exception:  # noqa: BLE001 - a group is a view of the finals: it never holds them up
                log.exception("question of utterance %s not grouped", event.utterance_id)
        sent = await asyncio.gather(*(self.queue.publish_event(group) for group in grown.values()), return_exceptions=True)
        for group, outcome in zip(grown.values(), sent):
            if isinstance(outcome, UNREACHABLE):
                log.warning("question group of room %s not sent: %s", group.room_id, outcome)
            elif isinstance(outcome, BaseException):
                log.error("question group of room %s not sent", group.room_id, exc_info=outcome)
