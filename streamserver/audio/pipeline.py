"""One student's audio path: decoded frames -> 16 kHz mono -> VAD -> Utterances (and, while the
student speaks, hints: partial and speculative Utterances of the same utterance_id)."""

from __future__ import annotations

from typing import Callable

import av
import numpy as np

from streamserver.audio.pacing import Pacer
from streamserver.audio.resample import To16kMono
from streamserver.audio.segmenter import SegmentedSpeech, SegmenterConfig, UtteranceSegmenter
from streamserver.events import Utterance, audio_digest


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
        on_hint: Callable[[Utterance], None] | None = None,
    ) -> None:
        self.room_id, self.student_id, self.student_name, self.language = room_id, student_id, student_name, language
        self._on_utterance = on_utterance
        self._on_speaking = on_speaking
        self._resample = To16kMono()
        self._on_hint = on_hint
        self._segmenter = UtteranceSegmenter(config or SegmenterConfig(), self._emit,
                                             on_hint=self._hint if on_hint else lambda _: None)
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
        self._on_utterance(self._utterance(speech))

    def _hint(self, speech: SegmentedSpeech) -> None:
        assert self._on_hint is not None
        self._on_hint(self._utterance(speech))

    def _utterance(self, speech: SegmentedSpeech) -> Utterance:
        return Utterance(
            utterance_id=speech.key,
            room_id=self.room_id,
            student_id=self.student_id,
            student_name=self.student_name,
            language=self.language,
            audio=speech.audio,
            start_ts=speech.start_ts,
            end_of_speech_ts=speech.end_of_speech_ts,
            cut=speech.cut,
            kind=speech.kind,
            revision=speech.revision,
            # a final and its speculation carry it, to be matched; a partial needs none
            digest=audio_digest(speech.audio) if speech.kind != "partial" else "",
        )
