"""What a recognition queue offers its two sides: the sink that fills it and the worker that
empties it. MemoryQueue and RedisQueue implement it; AsrWorker and UtteranceSink use only this."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from streamserver.bus.connect import REDIS_FAILURES

from streamserver.config import Bounds
from streamserver.events import Event, TranscriptEvent, TranscriptPartialEvent, Utterance, now

Entry = tuple[str, Utterance]  # (entry id in the queue, the utterance): "<ms since epoch>-<n>", as Redis makes them
# A queue that cannot be reached (Redis away, a socket error, a cluster failing a primary over):
# callers retry with backoff.
UNREACHABLE = REDIS_FAILURES
__all__ = ["Bounds", "Displaced", "Entry", "MAX_ATTEMPTS", "QueueFull", "Speculation", "UNREACHABLE", "UtteranceQueue"]
MAX_ATTEMPTS = 3  # a job whose recognition failed this often is given up, with an event
# Hints are best effort: one per utterance (the newest), speculative ones first, none older than
# this (a newer one, or the final, has made it pointless), at most HINTS_MAX waiting in all.
HINT_MAX_AGE_S = 5.0
HINTS_MAX = 10_000
SPECULATION_TTL_S = 30.0  # a speculative result waits this long for its final
PENDING_S = 2.0  # a final waits this long at most for its speculation that a worker is recognising


def queued_at(entry_id: str) -> float | None:
    """When a job was queued (epoch seconds), from its entry id; None for an id of another form."""
    ms, _, _ = entry_id.partition("-")
    return int(ms) / 1000 if ms.isdigit() else None


HINT_LEVELS = ("none", "speculative", "all")  # what a worker takes now (its heartbeat says)
# The hints the live workers take: the most any takes, and the rooms whose hints none of them
# takes (a CPU worker that one room keeps busy takes every other room's: AsrWorker.busiest_room).
HintWish = tuple[str, frozenset[str]]


def wanted_hints(stats: Iterable[dict[str, Any]]) -> HintWish:
    """From the live workers' heartbeat stats ("hints": a level; "hints_except": a room or ""):
    a hint no worker would take is not worth sending."""
    level, skipped = "none", None
    for s in stats:
        taken = s.get("hints", "none")
        if taken not in HINT_LEVELS or taken == "none":  # a worker that takes none has no say
            continue
        level = max(level, taken, key=HINT_LEVELS.index)
        theirs = frozenset([s["hints_except"]] if s.get("hints_except") else [])
        skipped = theirs if skipped is None else skipped & theirs
    return level, skipped or frozenset()


@dataclass
class Speculation:
    """A speculative utterance's result, waiting for its final: used only for the same audio."""

    digest: str
    event_json: str  # the TranscriptEvent (or NoSpeechEvent) it would publish; "" while it is recognised
    pending_until: float = 0.0  # while recognised: a final waits for it until then (epoch), not after

    @classmethod
    def in_progress(cls, digest: str, wait_s: float = PENDING_S) -> Speculation:
        """The mark of a speculation a worker is recognising: its final waits for it (wait_s at
        most: the worker may die) instead of being recognised a second time by another worker."""
        return cls(digest, "", now() + wait_s)

    def _of_audio(self, u: Utterance) -> bool:
        """Of this final's very audio (a final cut at the maximum length is never speculated on)."""
        return bool(u.digest) and u.digest == self.digest and not u.cut

    def pending_for(self, u: Utterance) -> bool:
        """Being recognised, for this very audio, and not given up on: its final should wait."""
        return not self.event_json and now() < self.pending_until and self._of_audio(u)

    def final_for(self, u: Utterance) -> TranscriptEvent | None:
        """The final's event, published now, if this result is of its very audio (and reads);
        None otherwise: the final is recognised as always."""
        if not self.event_json or not self._of_audio(u):
            return None
        try:
            event = TranscriptEvent.from_json(self.event_json)
        except (ValueError, TypeError, KeyError):
            return None
        event.published_ts, event.end_of_speech_ts = now(), u.end_of_speech_ts
        if u.stream_span is not None:  # a hint travels without its place on the student's clock
            event.stream_start, event.stream_end = round(u.stream_span[0], 3), round(u.stream_span[1], 3)
            event.recovered, event.stream_clock = u.recovered, u.stream_clock
        return event

    def to_json(self) -> str:
        return json.dumps({"digest": self.digest, "event": self.event_json, "pending_until": self.pending_until})

    @classmethod
    def from_json(cls, data: str | bytes) -> Speculation:
        fields = json.loads(data)
        return cls(fields["digest"], fields["event"], float(fields.get("pending_until", 0.0)))


@dataclass(frozen=True)
class Displaced:
    """A waiting utterance that gave its place in its room's queue to another source's
    (queue/fair.py gives_way): dropped, and said to the room as every drop is."""

    room_id: str
    utterance_id: str
    student_id: str
    end_of_speech_ts: float

    @classmethod
    def of(cls, u: Utterance) -> Displaced:
        return cls(u.room_id, u.utterance_id, u.student_id, u.end_of_speech_ts)


class QueueFull(Exception):
    """An utterance the queue refuses: `scope` ("student", "room" or "total") is the bound reached."""

    def __init__(self, scope: str, limit: int) -> None:
        super().__init__(f"{limit} utterances of this {scope} already wait for recognition" if scope != "total"
                         else f"{limit} utterances already wait for recognition")
        self.scope = scope


class UtteranceQueue(Protocol):
    # Whether a read takes jobs by per-room fair share from everything waiting (a room's next
    # utterance then waits only behind its turn), or in arrival order.
    fair: bool

    # ---- the sink's side ----
    async def submit(self, u: Utterance) -> Displaced | None:
        """Queue an utterance; the waiting one it displaced, if its room was at its bound and
        another source held more of it (queue/fair.py gives_way). QueueFull past a bound;
        UNREACHABLE errors on a queue that cannot be reached."""

    async def depth(self) -> int:
        """Jobs not yet published: waiting plus being recognised."""

    async def capacity(self) -> tuple[int, float]:
        """Live workers and their summed recent throughput (utterances/s)."""

    async def hints_wanted(self) -> HintWish:
        """"all", "speculative" or "none": the most hints any live worker takes now; and the
        rooms whose hints none takes."""

    async def backlog(self) -> dict[str, int]:
        """Jobs not yet published, per room (rooms with none are absent)."""

    async def offer(self, hint: Utterance) -> None:
        """Keep a hint (a partial or speculative Utterance) for a worker with time to spare; it
        replaces the utterance's previous hint. Best effort: nothing of it is durable."""

    async def speculation(self, utterance_id: str) -> Speculation | None:
        """The speculative result kept for this utterance, if any."""

    async def claim(self, event: TranscriptEvent) -> bool:
        """Publish a result made outside the job path (a speculation, a fallback) unless the
        utterance was published already (True: this one is the room's)."""

    async def done_of(self, utterance_ids: list[str]) -> set[str]:
        """Those of the utterances whose result is published (or that were found to be copies of
        a published one, queue/publication.py covered): the audio of the others is not safe yet."""

    async def sent_spans(self, room_id: str, spoken: str) -> list[tuple[float, float]]:
        """Spans (start, end) on a student clock (publication.spoken_of) of its utterances queued or
        published: audio sent again that they hold is a copy (audio/sent_again.py)."""

    keeps_spoken: bool  # the queue's spoken record survives a restart of this process (Redis)

    def remember_spoken(self, room_id: str, spoken: str, spans: list[tuple[float, float, bool]]) -> None:
        """Spans (start, end, recovered) of a student clock's utterances (publication.spoken_of) published
        before this process knew them."""

    # ---- the worker's side ----
    async def ensure_group(self) -> None:
        """Ready the queue for reading (after a restart of its store too)."""

    async def read(self, count: int, block_ms: int) -> list[Entry]:
        """Up to `count` new jobs for this worker, waiting up to block_ms for the first."""

    async def take_hints(self, count: int, partials: bool = True) -> list[Utterance]:
        """Up to `count` hints, speculative ones first, then partials oldest first (none when
        `partials` is False); each is taken once, none whose utterance is already published."""

    async def keep_speculations(self, speculations: dict[str, Speculation]) -> None:
        """Keep speculative results (or marks of ones in progress) for their finals
        (SPECULATION_TTL_S), by utterance id."""

    async def speculations(self, utterance_ids: list[str]) -> dict[str, Speculation]:
        """The speculative results kept for these utterances."""

    async def publish_partial(self, event: TranscriptPartialEvent) -> bool:
        """Send a partial to the room (not to its history) unless its utterance is published."""

    async def publish_event(self, event: Event) -> bool:
        """Send a room event of the worker's own (a question group) to the room, and to its
        history if the event is kept; False where the room's bus did not take it."""

    async def claim_orphans(self) -> list[Entry]:
        """Jobs delivered to a worker that died, or idle past the visibility timeout, now ours."""

    async def heartbeat(self, stats: dict[str, Any]) -> None:
        """This worker is alive; stats (utt_per_s) feed capacity()."""

    async def gateway_beat(self, gateway: str, stats: dict[str, Any]) -> None:
        """This gateway is alive: stats {students, utt_per_s} feed fleet_load()."""

    async def fleet_load(self) -> tuple[int, float, float, int]:
        """The live gateways' seated students and the finals/s they send; the live workers'
        summed capacity (utterances/s) and their number (capacity.py)."""

    async def complete(self, entry_id: str, u: Utterance, event: TranscriptEvent) -> bool:
        """Publish the result to the room and acknowledge the job, atomically; False when an
        earlier delivery of the same utterance already published it (nothing is sent again)."""

    async def attempt(self, entry_id: str) -> int:
        """Count a failed recognition of a job; how many there have been."""

    async def close(self) -> None: ...
