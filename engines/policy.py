"""How many mel frames the encoder sees for an utterance (the encoder input length policy).

Whisper was trained on 30 s windows; an utterance is padded with silence up to its window.
A shorter window saves encoder work in proportion, but cutting it too close makes greedy decoding
loop (the decoder never sees the end-of-audio region). benchmarks/encoder_length.py measures the
candidates on the dev clips; DEFAULT_POLICIES holds, per model, the fastest one that was no less
accurate than padding to 30 s (benchmarks/results/encoder-length.json, README "Encoder length").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engines.features import HOP_LENGTH, N_FRAMES, SAMPLE_RATE

FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100


@dataclass(frozen=True)
class EncoderPolicy:
    name: str
    min_seconds: float  # never shorter than this window
    bucket_seconds: float  # longer utterances round up to a multiple of this (0: to the frame)
    margin_seconds: float = 0.0  # silence kept after the audio before rounding

    def frames(self, n_samples: int) -> int:
        seconds = max(self.min_seconds, n_samples / SAMPLE_RATE + self.margin_seconds)
        if self.bucket_seconds:
            seconds = math.ceil(round(seconds / self.bucket_seconds, 6)) * self.bucket_seconds
        frames = math.ceil(seconds * FRAMES_PER_SECOND)
        frames += frames % 2  # the encoder's stride-2 convolution halves it
        return min(N_FRAMES, frames)


POLICIES = {
    p.name: p
    for p in (
        EncoderPolicy("pad30", 30.0, 0.0),
        EncoderPolicy("exact", 0.0, 0.0),
        EncoderPolicy("exact+1s", 0.0, 0.0, 1.0),
        EncoderPolicy("bucket5s", 0.0, 5.0),
        EncoderPolicy("min10s", 10.0, 5.0),
        EncoderPolicy("min15s", 15.0, 5.0),
        EncoderPolicy("min20s", 20.0, 5.0),
    )
}
# Measured (int8, 2 threads): tiny.en needs a longer window than base before it stops looping or
# dropping words; base was as accurate from 10 s on in English and in Mandarin.
DEFAULT_POLICIES = {"tiny.en": "min20s", "base": "min10s"}
FALLBACK_POLICY = "pad30"


def default_policy(model: str) -> str:
    return DEFAULT_POLICIES.get(model, FALLBACK_POLICY)
