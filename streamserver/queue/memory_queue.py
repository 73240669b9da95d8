"""The recognition queue in this process (`serve`): the same promises as the Redis Stream, kept
in memory for the ASR worker that runs beside the audio pipeline.

A read takes jobs by fair share (queue/fair.py: rooms, then sources inside a room) from
everything waiting (the whole queue is at hand here), so one room's backlog never holds back
another room's next utterance by more than a batch, nor one source's its classmates'. A waiting
utterance's audio is kept as PCM16, as a job on the Redis Stream is: a room's backlog at its
bound holds half the bytes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, OrderedDict
from dataclasses import replace
from typing import Any

import numpy as np

from streamserver.queue.fair import FairTurns, entry_share, gives_way
from streamserver.bus.ordered import OrderedPublisher
from streamserver.events import Event, TranscriptEvent, TranscriptPartialEvent, Utterance
from streamserver.queue.base import (
    HINT_MAX_AGE_S, HINTS_MAX, SPECULATION_TTL_S, Bounds, Displaced, Entry, QueueFull, Speculation, HintWish, wanted_hints,
)
from streamserver.queue.jobs import pcm16
from streamserver.queue.publication import SPOKEN_KEPT_S, PublishedHere, recent, spoken_of

ALIVE_TTL_S = 1.0  # as the Redis queue's: a worker silent this long has no capacity


class MemoryQueue:
    fair = True
    def __init__(self, publisher: OrderedPublisher, *, visibility_s: float = 30.0, bounds: Bounds = Bounds()) -> None:
        self.publisher = publisher
        self.visibility_s = visibility_s
        self.bounds = bounds
        self._per_room: Counter[str] = Counter()  # utterances not yet completed
        self._per_student: Counter[tuple[str, str]] = Counter()
        self._per_source: dict[str, Counter[str]] = {}  # room -> its places held per source (fair.py)
        self._turns = FairTurns()
        self._ids = itertools.count(1)
        self._waiting: list[Entry] = []  # their audio as PCM16 (_compact), as workers take it from Redis too
        self._pending: dict[str, tuple[Utterance, float]] = {}  # delivered, not completed: id -> (u, when)
        self._published = PublishedHere(publisher)  # stage 5: publish once (queue/publication.py)
        self._attempts: dict[str, int] = {}
        self._arrived = asyncio.Event()
        # (monotonic time, capacity utt/s, its stats) of the worker's last heartbeat
        self._beat: tuple[float, float, dict[str, Any]] = (-1e9, 0.0, {})
        self._gateway = (0, 0.0)  # (students, finals/s) of this process, its gateway part (capacity.py)
        # utterance id -> (its newest hint, monotonic time offered); a replaced hint keeps its place
        self._hints: OrderedDict[str, tuple[Utterance, float]] = OrderedDict()
        self._hinted: OrderedDict[str, None] = OrderedDict()  # utterances a worker took a hint of, the newest
        self._speculations: OrderedDict[str, tuple[Speculation, float]] = OrderedDict()
        # (room, student clock) -> spans queued, on that clock (sent_spans)
        self._sent: OrderedDict[tuple[str, str], list[tuple[float, float]]] = OrderedDict()

    async def submit(self, u: Utterance) -> Displaced | None:
        b, student = self.bounds, (u.room_id, u.student_id)
        if self._per_student[student] >= b.per_student:
            raise QueueFull("student", b.per_student)
        displaced = None
        if self._per_room[u.room_id] >= b.per_room:
            displaced = self._displace(u)
            if displaced is None:
                raise QueueFull("room", b.per_room)
        if len(self._waiting) + len(self._pending) >= b.total:
            raise QueueFull("total", b.total)
        self._count(u, 1)
        entry_id = f"{int(time.time() * 1000)}-{next(self._ids)}"  # as a Redis stream's: queue.base.queued_at
        self._waiting.append((entry_id, _compact(u)))
        if u.stream_span is not None:
            sent = recent(self._sent, (u.room_id, spoken_of(u.student_id, u.stream_clock)))
            sent.append(u.stream_span)
            sent[:] = [s for s in sent if s[1] > u.stream_span[1] - SPOKEN_KEPT_S]
        self._hints.pop(u.utterance_id, None)  # the final makes its hint pointless
        self._arrived.set()
        return displaced

    def _displace(self, u: Utterance) -> Displaced | None:
        """The room is at its bound: the newest waiting utterance of the source holding the most
        of it gives its place to `u`, if u's source holds fewer (fair.gives_way)."""
        most = gives_way(self._per_source.get(u.room_id, {}), u.source)
        for i in range(len(self._waiting) - 1, -1, -1) if most is not None else ():
            victim = self._waiting[i][1]
            if victim.room_id == u.room_id and victim.source == most:
                del self._waiting[i]
                self._count(victim, -1)
                return Displaced.of(victim)
        return None

    def _count(self, u: Utterance, n: int) -> None:
        """Count an utterance in (n=1) or out (n=-1) of its room's, its student's and its source's places."""
        sources = self._per_source.setdefault(u.room_id, Counter())
        for counts, key in ((self._per_room, u.room_id), (self._per_student, (u.room_id, u.student_id)), (sources, u.source)):
            counts[key] += n
            if counts[key] <= 0:
                del counts[key]
        if not sources:
            del self._per_source[u.room_id]

    async def offer(self, hint: Utterance) -> None:
        if hint.utterance_id in self._published or (hint.utterance_id not in self._hints and len(self._hints) >= HINTS_MAX):
            return
        self._hints[hint.utterance_id] = (hint, time.monotonic())
        self._arrived.set()  # a worker waiting for finals looks at hints

    async def take_hints(self, count: int, partials: bool = True) -> list[Utterance]:
        oldest = time.monotonic() - HINT_MAX_AGE_S
        for uid in [uid for uid, (_, at) in self._hints.items() if at < oldest]:
            del self._hints[uid]
        # Speculative ones first, then utterances' first captions, then revisions (as in Redis:
        # bus/keys.py FIRST_CAPTION_AHEAD_S), each in the order offered.
        ranks = {"speculative": 0, "partial": 1} if partials else {"speculative": 0}
        held = [u for u, _ in self._hints.values() if u.kind in ranks]
        taken = sorted(held, key=lambda u: (ranks[u.kind], u.utterance_id in self._hinted))[:count]
        for u in taken:
            del self._hints[u.utterance_id]
            self._hinted[u.utterance_id] = None
        while len(self._hinted) > HINTS_MAX:
            self._hinted.popitem(last=False)
        return taken

    async def keep_speculations(self, speculations: dict[str, Speculation]) -> None:
        for utterance_id, speculation in speculations.items():
            self._speculations[utterance_id] = (speculation, time.monotonic())
            self._speculations.move_to_end(utterance_id)
        while self._speculations and next(iter(self._speculations.values()))[1] < time.monotonic() - SPECULATION_TTL_S:
            self._speculations.popitem(last=False)

    async def speculation(self, utterance_id: str) -> Speculation | None:
        kept = self._speculations.get(utterance_id)
        return kept[0] if kept else None

    async def speculations(self, utterance_ids: list[str]) -> dict[str, Speculation]:
        return {uid: kept[0] for uid in utterance_ids if (kept := self._speculations.get(uid))}

    async def publish_partial(self, event: TranscriptPartialEvent) -> bool:
        if event.utterance_id in self._published:
            return False
        return await self.publisher.publish(event)

    async def claim(self, event: TranscriptEvent) -> bool:
        return await self._publish_once(event)

    async def publish_event(self, event: Event) -> bool:
        return await self.publisher.publish(event)

    async def _publish_once(self, event: TranscriptEvent) -> bool:
        self._speculations.pop(event.utterance_id, None)
        return await self._published.publish_once(event)

    keeps_spoken = False  # a restarted `serve` starts empty: the room's history refills it

    def remember_spoken(self, room_id: str, spoken: str, spans: list[tuple[float, float, bool]]) -> None:
        """Spans published before this process started (from the room's history)."""
        record = self._published.spoken(room_id, spoken)
        record += [s for s in spans if s not in record]

    async def sent_spans(self, room_id: str, spoken: str) -> list[tuple[float, float]]:
        published = [(s, e) for s, e, _ in self._published.spoken(room_id, spoken)]
        return recent(self._sent, (room_id, spoken)) + published

    async def done_of(self, utterance_ids: list[str]) -> set[str]:
        return {uid for uid in utterance_ids if uid in self._published}

    async def depth(self) -> int:
        return len(self._waiting) + len(self._pending)

    async def backlog(self) -> dict[str, int]:
        return dict(self._per_room)

    async def capacity(self) -> tuple[int, float]:
        when, rate, _ = self._beat
        return (1, rate) if time.monotonic() - when < ALIVE_TTL_S else (0, 0.0)

    async def hints_wanted(self) -> HintWish:
        when, _, stats = self._beat
        return wanted_hints([stats] if time.monotonic() - when < ALIVE_TTL_S else [])

    async def ensure_group(self) -> None:
        return None

    async def read(self, count: int, block_ms: int) -> list[Entry]:
        if not self._waiting:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), block_ms / 1000)
            except TimeoutError:
                return []
        batch = self._turns.batch(self._waiting, count, entry_share)
        delivered = time.monotonic()
        self._pending.update((entry_id, (u, delivered)) for entry_id, u in batch)
        return list(batch)

    async def claim_orphans(self) -> list[Entry]:
        """Jobs delivered longer than the visibility timeout ago and not completed (their
        recognition failed): delivered again, as the Redis queue's XAUTOCLAIM does."""
        now = time.monotonic()
        stale = [(entry_id, u) for entry_id, (u, when) in self._pending.items() if now - when >= self.visibility_s]
        for entry_id, u in stale:
            self._pending[entry_id] = (u, now)
        return stale

    async def heartbeat(self, stats: dict[str, Any]) -> None:
        rate = float(stats.get("capacity", stats.get("utt_per_s", 0.0)))
        self._beat = (time.monotonic(), rate, stats)

    async def gateway_beat(self, gateway: str, stats: dict[str, Any]) -> None:
        self._gateway = (int(stats.get("students", 0)), float(stats.get("utt_per_s", 0.0)))

    async def fleet_load(self) -> tuple[int, float, float, int]:
        workers, rate = await self.capacity()
        return (*self._gateway, rate, workers)

    async def complete(self, entry_id: str, u: Utterance, event: TranscriptEvent) -> bool:
        fresh = await self._publish_once(event)  # raising: kept pending, the worker retries the completion
        if self._pending.pop(entry_id, None) is not None:
            self._count(u, -1)
        self._attempts.pop(entry_id, None)
        return fresh

    async def attempt(self, entry_id: str) -> int:
        self._attempts[entry_id] = self._attempts.get(entry_id, 0) + 1
        return self._attempts[entry_id]

    async def close(self) -> None:
        return None


def _compact(u: Utterance) -> Utterance:
    return replace(u, audio=np.frombuffer(pcm16(u.audio), "<i2"))

