"""The messages that flow through the server, each a dataclass with one JSON encoding.

audio (transport) -> Utterance (audio pipeline) -> UtteranceQueued (sink) -> TranscriptEvent,
NoSpeechEvent or UtteranceFailedEvent (ASR worker) -> room channel; StudentEvent for the roster.
While a student speaks, the pipeline also hands out hints (Utterance with kind "partial" or
"speculative", best effort): the worker answers a partial with a TranscriptPartialEvent (live
caption, never kept in the history) and a speculative one with a result kept for its final.
Every message a room's dashboard receives is built here and encoded by `to_json`, and every
event the server reads back (from the bus, a room's history) is decoded here: `event_type`, `decode`.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np


def now() -> float:
    """Server clock, epoch seconds: every timestamp in an event uses it."""
    return time.time()


@dataclass
class Utterance:
    """One stretch of a student's speech, cut by the VAD (travels to workers as a job, never to a room)."""

    utterance_id: str
    room_id: str
    student_id: str
    student_name: str
    language: str  # the room's: "en", "zh" or "auto"
    audio: np.ndarray = field(repr=False)  # mono 16 kHz: float32 as cut, int16 PCM as queued (engines take either)
    start_ts: float  # arrival of its first voiced frame
    end_of_speech_ts: float  # arrival of its last voiced frame, before the VAD's hangover
    cut: bool = False  # ended by the maximum length, not by a pause
    # "final": the utterance, recognised and published once. A hint, best effort: "partial" (the
    # speech so far, while the student speaks; `revision` counts them) or "speculative" (the
    # utterance as it will be if the pause that began is its end, recognised ahead of the VAD).
    kind: str = "final"
    revision: int = 0
    digest: str = ""  # of the audio (audio_digest): a speculative result serves the final it matches
    # Where the audio lies on the student's own clock (seconds since its page started recording),
    # when its client keeps its audio to send again after a break (audio/timeline.py) ...
    stream_span: tuple[float, float] | None = None
    recovered: bool = False  # ... and it was sent again: spoken before a break, recognised after
    stream_clock: str = ""  # which clock: one per page load (a reload starts a new one at 0)
    # Whose share of the room's queue it counts in (queue/fair.py): the client address of the
    # room's shared link, the link of a per-student one ("link:<student>").
    source: str = ""

    @property
    def is_hint(self) -> bool:
        return self.kind != "final"


def audio_digest(audio: np.ndarray) -> str:
    """Identifies an utterance's audio: a speculative result is used only for the same samples."""
    return f"{audio.size}:{zlib.crc32(np.ascontiguousarray(audio).view(np.uint8)):08x}"


class Message:
    """What a dashboard receives: a dataclass whose fields are its JSON object."""

    type: str

    def to_dict(self) -> dict[str, Any]:
        """Its JSON object, "type" first: `event_type` reads the type from the start of the text."""
        return {"type": self.type, **{f.name: getattr(self, f.name) for f in fields(self)}}  # type: ignore[arg-type]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)


class Event(Message):
    """A room event: published on the room's channel (or this process's own feeds: bus/local.py)."""

    room_id: str
    kept: ClassVar[bool] = True  # appended to the room's history (replayed to a dashboard that joins)


@dataclass
class StudentEvent(Event):
    room_id: str
    student_id: str
    student_name: str
    type: str  # "student_joined" | "student_left" | "speaking_started" | "speaking_stopped"
    ts: float = field(default_factory=now)


@dataclass
class RoomClosedEvent(Event):
    """The room was closed: its dashboards and students are sent away, its links stop working."""

    room_id: str
    ts: float = field(default_factory=now)
    type: str = "room_closed"


@dataclass
class TranscriptionSourceEvent(Event):
    """Where a gateway's transcripts come from: "central" (the workers behind the bus) or "local"
    (its fallback model, while its uplink is down). Its dashboards show it in their header."""

    room_id: str
    source: str
    type: str = "transcription_source"


@dataclass
class History(Message):
    """The first message of a dashboard's feed: the room's events so far, decoded."""

    events: list[dict[str, Any]]
    type: str = "history"


@dataclass
class Roster(Message):
    """The second message of a dashboard's feed: who is in the room now, through any gateway (DashboardFeed.roster)."""

    room_name: str
    students: list[dict[str, Any]]
    type: str = "roster"


@dataclass
class UtteranceQueued(Event):
    """An utterance is on its way to recognition: a dashboard (and the load simulator) can tell a
    transcript that is late from one that was lost."""

    room_id: str
    utterance_id: str
    student_id: str
    end_of_speech_ts: float
    ts: float = field(default_factory=now)
    type: str = "utterance_queued"

    @classmethod
    def of(cls, u: Utterance) -> UtteranceQueued:
        return cls(u.room_id, u.utterance_id, u.student_id, u.end_of_speech_ts)


@dataclass
class UtteranceDropped(Event):
    """An utterance the recognition queue refused (its student, its room or the whole queue was
    at its bound), or one that gave its place to another source's at its room's bound: said out
    loud, never lost in silence."""

    room_id: str
    utterance_id: str
    student_id: str
    end_of_speech_ts: float
    reason: str
    ts: float = field(default_factory=now)
    type: str = "utterance_dropped"

    @classmethod
    def of(cls, u: Utterance, reason: str) -> UtteranceDropped:
        return cls(u.room_id, u.utterance_id, u.student_id, u.end_of_speech_ts, reason)


@dataclass
class _Words(Event):
    """What a student said: the fields a final and a live caption share, in this order."""

    room_id: str
    utterance_id: str
    student_id: str
    student_name: str
    text: str
    language: str


@dataclass
class TranscriptEvent(_Words):
    """The result of one utterance, stamped as published when it is built."""

    start_ts: float
    end_of_speech_ts: float
    published_ts: float
    type: str = "transcript"
    intent: dict[str, Any] | None = None
    fallback: bool = False  # recognised by an on-prem gateway's fallback model, not a central worker
    # The utterance's place on the student's clock (Utterance.stream_span): a recovered utterance
    # that a transcript before the break already covers is not published again.
    stream_start: float | None = None
    stream_end: float | None = None
    recovered: bool = False  # spoken before a break (network, server), sent again by the student's page
    stream_clock: str = ""

    @classmethod
    def from_json(cls, data: str | bytes) -> TranscriptEvent:
        """A transcript or no-speech event as to_json wrote it (ValueError or TypeError for
        anything else)."""
        event = decode(data)
        if not isinstance(event, TranscriptEvent) or event.type not in (TranscriptEvent.type, NoSpeechEvent.type):
            raise ValueError(f"not a transcript event: {event.type!r}")
        return event

    @classmethod
    def of(cls, u: Utterance, text: str, language: str, intent: dict[str, Any] | None = None) -> TranscriptEvent:
        return cls(u.room_id, u.utterance_id, u.student_id, u.student_name, text, language,
                   u.start_ts, u.end_of_speech_ts, now(), intent=intent, **_placed(u))


def _placed(u: Utterance) -> dict[str, Any]:
    """The stream fields of a transcript of `u` (none when its client keeps no audio)."""
    if u.stream_span is None:
        return {}
    return {"stream_start": round(u.stream_span[0], 3), "stream_end": round(u.stream_span[1], 3), "recovered": u.recovered,
            "stream_clock": u.stream_clock}


@dataclass
class NoSpeechEvent(TranscriptEvent):
    """The utterance had no words (noise, a cough): accounted for, not shown."""

    type: str = "no_speech"

    @classmethod
    def of(cls, u: Utterance, text: str = "", language: str = "", intent: dict[str, Any] | None = None) -> NoSpeechEvent:
        return cls(u.room_id, u.utterance_id, u.student_id, u.student_name, "", language or u.language,
                   u.start_ts, u.end_of_speech_ts, now(), **_placed(u))


@dataclass
class UtteranceFailedEvent(TranscriptEvent):
    """Recognition failed on every attempt: the room learns the utterance is given up."""

    type: str = "utterance_failed"

    @classmethod
    def of(cls, u: Utterance, text: str = "", language: str = "", intent: dict[str, Any] | None = None) -> UtteranceFailedEvent:
        return cls(u.room_id, u.utterance_id, u.student_id, u.student_name, "", u.language,
                   u.start_ts, u.end_of_speech_ts, now(), **_placed(u))


@dataclass
class TranscriptPartialEvent(_Words):
    """The text so far of an utterance still being spoken: provisional, replaced by its final
    (same utterance_id); a newer revision replaces an older one. Live only: not in the history."""

    revision: int
    start_ts: float
    published_ts: float
    type: str = "transcript_partial"
    kept: ClassVar[bool] = False

    @classmethod
    def of(cls, u: Utterance, text: str, language: str) -> TranscriptPartialEvent:
        return cls(u.room_id, u.utterance_id, u.student_id, u.student_name, text, language, u.revision, u.start_ts, now())


@dataclass
class QuestionGroupEvent(Event):
    """A group of the room's questions and help requests that asks one thing (intent/groups.py)
    as it stands after it grew: its count, its students, its representative question, when it
    last grew; open again (answered False) once asked after the teacher marked it answered. The
    group id names the worker that keeps the group (AsrWorker.groups_id)."""

    room_id: str
    group_id: str
    question: str
    count: int
    students: int
    last_at: float
    answered: bool = False
    type: str = "question_group"


@dataclass
class QuestionGroupAnsweredEvent(Event):
    """The teacher marked a question group answered (POST .../question_groups/<id>/answered):
    every dashboard of the room shows it so, until a question joins it again."""

    room_id: str
    group_id: str
    ts: float = field(default_factory=now)
    type: str = "question_group_answered"


STUDENT_TYPES = ("student_joined", "student_left", "speaking_started", "speaking_stopped")  # StudentEvent's
# An utterance's result: one per utterance, whichever way it reaches a dashboard.
RESULT_TYPES = (TranscriptEvent.type, NoSpeechEvent.type, UtteranceFailedEvent.type)
MESSAGES: dict[str, type[Message]] = {
    **dict.fromkeys(STUDENT_TYPES, StudentEvent),
    **{kind.type: kind for kind in (RoomClosedEvent, TranscriptionSourceEvent, History, Roster, UtteranceQueued,
                                    UtteranceDropped, TranscriptEvent, NoSpeechEvent, UtteranceFailedEvent,
                                    TranscriptPartialEvent, QuestionGroupEvent, QuestionGroupAnsweredEvent)},
}
# What Message.to_json writes first. The bus, the queue and every dashboard feed ask each event's
# type (thousands a second in a lecture), so the type is read from here without parsing the rest.
_TYPE_FIRST = '{"type": "'
_TYPE_FIRST_BYTES = _TYPE_FIRST.encode()


def event_type(raw: str | bytes) -> str | None:
    """The "type" of an event's JSON; None for JSON that is not an object with a string "type".

    The text's first characters hold it (Message.to_dict puts it there): reading them costs a
    few characters, less than any search of the text, and nothing later in the text (what a
    student says) can pass for it. JSON from another encoder (the type elsewhere, other spacing)
    and a type with an escape in it (none of ours) are parsed whole."""
    if isinstance(raw, str):
        if raw.startswith(_TYPE_FIRST):
            end = raw.find('"', len(_TYPE_FIRST))
            if end > 0 and "\\" not in (kind := raw[len(_TYPE_FIRST) : end]):
                return kind
    elif raw.startswith(_TYPE_FIRST_BYTES):
        end = raw.find(b'"', len(_TYPE_FIRST_BYTES))
        if end > 0 and b"\\" not in (head := raw[len(_TYPE_FIRST_BYTES) : end]):
            return head.decode("utf-8", "replace")
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    found = parsed.get("type") if isinstance(parsed, dict) else None
    return found if isinstance(found, str) else None


def decode(raw: str | bytes) -> Message:
    """The message that `raw` (Message.to_json's text) encodes, of the class its "type" names.
    ValueError for text that is not one (bad JSON, no or an unknown type), TypeError for fields
    its class does not have."""
    parsed = json.loads(raw)
    kind = MESSAGES.get(parsed.get("type")) if isinstance(parsed, dict) else None
    if kind is None:
        raise ValueError(f"not a message: {str(raw)[:80]!r}")
    return kind(**parsed)
