"""How many mel frames the encoder sees for an utterance (the encoder input length policy).

Whisper was trained on 30 s windows; an utterance is padded with silence up to its window.
A shorter window saves encoder work in proportion, but cutting it too close makes greedy decoding
loop (the decoder never sees the end-of-audio region). benchmarks/encoder_length.py measures the
candidates on the dev clips; DEFAULT_POLICIES holds, per model, the fastest one that is no less
accurate than padding to 30 s (benchmarks/README.md, "Encoder length").
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
    pad_value: float | None = None  # None: Whisper's log-mel of silence; 0.0: faster-whisper's

    def frames(self, n_samples: int) -> int:
        seconds = max(self.min_seconds, n_samples / SAMPLE_RATE + self.margin_seconds)
        if self.bucket_seconds:
            seconds = math.ceil(round(seconds / self.bucket_seconds, 6)) * self.bucket_seconds
        frames = math.ceil(seconds * FRAMES_PER_SECOND)
        frames += frames % 2  # the encoder's stride-2 convolution halves it
        return min(N_FRAMES, frames)


_WINDOWS = (
    EncoderPolicy("pad30", 30.0, 0.0),
    EncoderPolicy("exact", 0.0, 0.0),
    EncoderPolicy("exact+1s", 0.0, 0.0, 1.0),
    EncoderPolicy("bucket5s", 0.0, 5.0),
    EncoderPolicy("min10s", 10.0, 5.0),
    EncoderPolicy("min15s", 15.0, 5.0),
    EncoderPolicy("min20s", 20.0, 5.0),
)
# Each window with Whisper's padding (the log-mel of silence) and with faster-whisper's
# (0.0 after normalisation, "-zero"): the padding alone changed several transcripts.
POLICIES = {
    p.name: p
    for w in _WINDOWS
    for p in (w, EncoderPolicy(w.name + "-zero", w.min_seconds, w.bucket_seconds, w.margin_seconds, 0.0))
}
# Each model's fastest window that loses no accuracy against padding to 30 s: tiny.en loses
# words at every shorter window, base keeps its accuracy down to 10 s, and zero padding is as
# accurate or more at every window (benchmarks/encoder_length.py; benchmarks/README.md,
# "Encoder length").
DEFAULT_POLICIES = {"tiny.en": "pad30-zero", "base": "min10s-zero"}


# Live captions (replaced by their final seconds later) trade some accuracy for engine time on a
# CPU: tiny.en at min10s-zero is 2.9x cheaper than its final's pad30-zero (48 against 137 ms
# median on the dev clips) at 7.8 % against 4.8 % errors, no loops left (benchmarks/README.md,
# "Encoder length"). A model not listed captions at its final's window.
CAPTION_WINDOWS = {"tiny.en": "min10s-zero"}


def default_policy(model: str) -> str:
    return DEFAULT_POLICIES.get(model, "pad30-zero")


def caption_policy(model: str) -> str | None:
    return CAPTION_WINDOWS.get(model)
