"""Every message a dashboard receives is built in streamserver/events.py: each class encodes to
the JSON the wire carries (what teacher.js and the load simulator read), decodes back to itself,
and `event_type` names its type from the text as `decode` does from the whole."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from streamserver.rooms.feed import Seen
from streamserver.bus.keys import is_final_transcript
from streamserver.events import (
    MESSAGES, RESULT_TYPES, STUDENT_TYPES, History, Message, NoSpeechEvent, QuestionGroupAnsweredEvent, QuestionGroupEvent,
    RoomClosedEvent, Roster, StudentEvent,
    TranscriptEvent, TranscriptionSourceEvent, TranscriptPartialEvent, Utterance, UtteranceDropped, UtteranceFailedEvent,
    UtteranceQueued, decode, event_type,
)

WORDS = {"room_id": "r1", "utterance_id": "u1", "student_id": "s1", "student_name": "Ann \"A\" Lee", "text": "我 \\ \"type\": \"room_closed\"",
         "language": "zh"}
RESULT = {**WORDS, "start_ts": 10.0, "end_of_speech_ts": 12.5, "published_ts": 13.25}
PLACED = {"intent": {"label": "question", "score": 0.9, "type": "x"}, "fallback": True, "stream_start": 1.5, "stream_end": 4.0,
          "recovered": True, "stream_clock": "c1"}
UNPLACED = {"intent": None, "fallback": False, "stream_start": None, "stream_end": None, "recovered": False, "stream_clock": ""}

# (the message, its JSON object on the wire: "type" first, then its fields in order)
CASES: list[tuple[Message, dict[str, Any]]] = [
    *[(StudentEvent("r1", "s1", "Ann", kind, ts=5.0),
       {"type": kind, "room_id": "r1", "student_id": "s1", "student_name": "Ann", "ts": 5.0}) for kind in STUDENT_TYPES],
    (RoomClosedEvent("r1", ts=7.0), {"type": "room_closed", "room_id": "r1", "ts": 7.0}),
    (TranscriptionSourceEvent("r1", "local"), {"type": "transcription_source", "room_id": "r1", "source": "local"}),
    (QuestionGroupEvent("r1", "w1.ab12cd:4", "为什么 \"type\"?", 3, 2, 14.0),
     {"type": "question_group", "room_id": "r1", "group_id": "w1.ab12cd:4", "question": "为什么 \"type\"?", "count": 3,
      "students": 2, "last_at": 14.0, "answered": False}),
    (QuestionGroupAnsweredEvent("r1", "w1.ab12cd:4", ts=15.0),
     {"type": "question_group_answered", "room_id": "r1", "group_id": "w1.ab12cd:4", "ts": 15.0}),
    (History([{"type": "room_closed", "room_id": "r1", "ts": 7.0}]),
     {"type": "history", "events": [{"type": "room_closed", "room_id": "r1", "ts": 7.0}]}),
    (Roster("Physics", [{"student_id": "s1", "student_name": "Ann", "speaking": False}]),
     {"type": "roster", "room_name": "Physics", "students": [{"student_id": "s1", "student_name": "Ann", "speaking": False}]}),
    (UtteranceQueued("r1", "u1", "s1", 12.5, ts=12.6),
     {"type": "utterance_queued", "room_id": "r1", "utterance_id": "u1", "student_id": "s1", "end_of_speech_ts": 12.5, "ts": 12.6}),
    (UtteranceDropped("r1", "u1", "s1", 12.5, "room", ts=12.6),
     {"type": "utterance_dropped", "room_id": "r1", "utterance_id": "u1", "student_id": "s1", "end_of_speech_ts": 12.5,
      "reason": "room", "ts": 12.6}),
    (TranscriptEvent(*RESULT.values(), **PLACED), {"type": "transcript", **RESULT, **PLACED}),
    (TranscriptEvent(*RESULT.values()), {"type": "transcript", **RESULT, **UNPLACED}),
    (NoSpeechEvent(*RESULT.values()), {"type": "no_speech", **RESULT, **UNPLACED}),
    (UtteranceFailedEvent(*RESULT.values()), {"type": "utterance_failed", **RESULT, **UNPLACED}),
    (TranscriptPartialEvent(*WORDS.values(), 3, 10.0, 11.0),
     {"type": "transcript_partial", **WORDS, "revision": 3, "start_ts": 10.0, "published_ts": 11.0}),
]


def test_every_message_class_has_a_case():
    assert {type(message) for message, _ in CASES} == set(MESSAGES.values())
    assert {message.type for message, _ in CASES} == set(MESSAGES)


@pytest.mark.parametrize("message, wire", CASES, ids=[m.type for m, _ in CASES])
def test_a_message_is_its_wire_json_and_decodes_to_itself(message: Message, wire: dict[str, Any]):
    text = message.to_json()
    assert text == json.dumps(wire, ensure_ascii=False)  # the same text, key order included
    assert decode(text) == message and decode(text.encode()) == message
    assert decode(text).to_json() == text
    assert event_type(text) == event_type(text.encode()) == wire["type"]


@pytest.mark.parametrize("raw, kind", [
    ('{"room_id": "r1", "type": "transcript", "text": "hi"}', "transcript"),  # another encoder: the type elsewhere
    ('{"type":"no_speech","room_id":"r1"}', "no_speech"),  # compact separators
    (b'{"text": "\\"type\\": \\"room_closed\\"", "type": "transcript"}', "transcript"),
    ('{"type": "a\\"b", "x": 1}', 'a"b'),  # an escape in the type: parsed whole
    ('{"type": 3}', None), ('{"kind": "transcript"}', None), ("[1, 2]", None), ("not json", None), (b"\xff", None),
])
def test_event_type_of_json_from_elsewhere(raw: str | bytes, kind: str | None):
    assert event_type(raw) == kind


@pytest.mark.parametrize("raw", ['{"type": "dance", "room_id": "r1"}', '{"room_id": "r1"}', "[1]", "nope"])
def test_decode_refuses_what_is_no_message(raw: str):
    with pytest.raises(ValueError):
        decode(raw)


def test_decode_refuses_fields_its_class_lacks():
    with pytest.raises(TypeError):
        decode('{"type": "room_closed", "room_id": "r1", "ts": 1.0, "colour": "red"}')


def test_from_json_takes_transcripts_and_no_speech_only():
    final, none = CASES[-5][0], CASES[-3][0]
    assert TranscriptEvent.from_json(final.to_json()) == final and TranscriptEvent.from_json(none.to_json()) == none
    for other in (CASES[-2][0], CASES[-1][0], RoomClosedEvent("r1")):
        with pytest.raises(ValueError):
            TranscriptEvent.from_json(other.to_json())


def test_only_a_final_transcript_goes_to_the_class_transcript():
    kept = [m.type for m, _ in CASES if is_final_transcript(m.to_json())]
    assert kept == ["transcript", "transcript"]
    assert not is_final_transcript(TranscriptPartialEvent("r1", "u", "s", "n", '"type": "transcript"', "en", 1, 0.0, 0.0).to_json())


def test_the_feed_shows_an_event_once_and_an_utterance_one_result():
    u = Utterance("u1", "r1", "s1", "Ann", "en", np.zeros(160, np.float32), 1.0, 2.0, revision=1)
    partial, queued = TranscriptPartialEvent.of(u, "he", "en").to_json(), UtteranceQueued.of(u).to_json()
    final, failed = TranscriptEvent.of(u, "hello", "en").to_json(), UtteranceFailedEvent.of(u).to_json()
    seen = Seen()
    shown = [seen.first(e) for e in (queued, queued, partial, final, final, failed, partial)]
    assert shown == [True, False, True, True, False, False, False]
    assert set(RESULT_TYPES) == {"transcript", "no_speech", "utterance_failed"}
