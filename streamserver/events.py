"""The messages that flow through the server, each with one JSON encoding used everywhere.

audio (transport) -> Utterance (audio pipeline) -> TranscriptEvent (ASR worker) -> room channel
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


def now() -> float:
    """Server clock, epoch seconds: every timestamp in an event uses it."""
    return time.time()


@dataclass
class Utterance:
    """One stretch of a student's speech, cut by the VAD (never leaves the process as audio)."""

    utterance_id: str
    room_id: str
    student_id: str
    student_name: str
    language: str  # the room's: "en", "zh" or "auto"
    audio: np.ndarray = field(repr=False)  # float32 mono 16 kHz
    start_ts: float  # arrival of its first voiced frame
    end_of_speech_ts: float  # arrival of its last voiced frame, before the VAD's hangover
    cut: bool = False  # ended by the maximum length, not by a pause


@dataclass
class TranscriptEvent:
    room_id: str
    utterance_id: str
    student_id: str
    student_name: str
    text: str
    language: str
    start_ts: float
    end_of_speech_ts: float
    published_ts: float
    type: str = "transcript"
    intent: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def of(cls, utterance: Utterance, text: str, language: str) -> "TranscriptEvent":
        """The transcript of an utterance, stamped as published now."""
        u = utterance
        return cls(u.room_id, u.utterance_id, u.student_id, u.student_name, text, language, u.start_ts, u.end_of_speech_ts, now())


@dataclass
class StudentEvent:
    room_id: str
    student_id: str
    student_name: str
    type: str  # "student_joined" | "student_left" | "speaking_started" | "speaking_stopped"
    ts: float = field(default_factory=now)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def room_channel(room_id: str) -> str:
    return f"room:{room_id}"
