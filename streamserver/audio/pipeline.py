"""One student's audio path: decoded frames -> 16 kHz mono -> VAD -> Utterances."""

from __future__ import annotations

import uuid
from typing import Callable

import av
import numpy as np

from streamserver.audio.pacing import Pacer
from streamserver.audio.resample import To16kMono
from streamserver.audio.segmenter import SegmentedSpeech, SegmenterConfig, UtteranceSegmenter
from streamserver.events import Utterance


class StudentAudio:
    def __init__(
        self,
        room_id: str,
        student_id: str,
        student_name: str,
        language: str,
        on_utterance: Callable[[Utterance], None],
        on_speaking: Callable[[bool], None] | None = None,
        config: SegmenterConfig | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.room_id, self.student_id, self.student_name, self.language = room_id, student_id, student_name, language
        self._on_utterance = on_utterance
        self._on_speaking = on_speaking
        self._resample = To16kMono()
        self._segmenter = UtteranceSegmenter(config or SegmenterConfig(), self._emit)
        self._speaking = False
        self._pacer = pacer or Pacer()

    def push_frame(self, frame: av.AudioFrame) -> None:
        self.push_pcm16(self._resample.push(frame))

    def push_pcm16(self, pcm: np.ndarray) -> None:
        """Raises TooFast (nothing of it kept) when the stream outruns real time."""
        self._pacer.take(pcm.size)
        self._segmenter.feed(pcm)
        if self._on_speaking and self._segmenter.speaking != self._speaking:
            self._speaking = self._segmenter.speaking
            self._on_speaking(self._speaking)

    def close(self) -> None:
        self._segmenter.flush()
        if self._speaking and self._on_speaking:
            self._speaking = False
            self._on_speaking(False)

    def _emit(self, speech: SegmentedSpeech) -> None:
        self._on_utterance(
            Utterance(
                utterance_id=uuid.uuid4().hex,
                room_id=self.room_id,
                student_id=self.student_id,
                student_name=self.student_name,
                language=self.language,
                audio=speech.audio,
                start_ts=speech.start_ts,
                end_of_speech_ts=speech.end_of_speech_ts,
                cut=speech.cut,
            )
        )
