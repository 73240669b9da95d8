"""What a stage hands on to the next (streamserver/stages.py), kept in lists for a test to read:
the test's own ears at a stage's output, standing in for no part of the server."""

from __future__ import annotations

import numpy as np

from streamserver.audio.segmenter import SegmentedSpeech


class PcmList(list):
    """A PcmTaker: each piece of audio, in order."""

    def push_pcm16(self, pcm: np.ndarray) -> None:
        self.append(pcm)


class Kept(list):
    """A SpeechTaker (what the VAD cuts) or an UtteranceTaker (what the student's audio hands the
    sink): the finished utterances (the list) and the hints (.hints)."""

    def __init__(self) -> None:
        super().__init__()
        self.hints: list = []

    def speech(self, speech: SegmentedSpeech) -> None:
        self.append(speech)

    submit = speech

    def speech_so_far(self, speech: SegmentedSpeech) -> None:
        self.hints.append(speech)

    hint = speech_so_far


SpeechList = UtteranceList = Kept  # named for the stage a test listens to


class PcmTo:
    """A PcmTaker that hands each piece to a function of the test's."""

    def __init__(self, take) -> None:  # noqa: ANN001 - any function of one array
        self.take = take

    def push_pcm16(self, pcm: np.ndarray) -> None:
        self.take(pcm)
