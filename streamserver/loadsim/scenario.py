"""What a simulated student says and when: real speech clips with classroom-like turn-taking.

Each student alternates silence and one clip. Silences are drawn so that on average a fraction
`speak_ratio` of the students is speaking at any moment, and never shorter than MIN_GAP_S, so
that the server's VAD cuts exactly one utterance per clip at hangovers from 240 ms to 1 s
(docs/operations.md, "Other commands", the load simulator; the default is 500 ms,
`--vad-hangover-ms`).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.features import SAMPLE_RATE as RATE
from streamserver.loadsim.config import LoadConfig

CLIPS_DIR = Path(__file__).resolve().parent / "clips"
MIN_GAP_S = 1.0
WARMUP_CYCLES = 4


@dataclass(frozen=True)
class Clip:
    name: str
    pcm: bytes  # little-endian int16 mono 16 kHz, padded with silence to whole frames
    text: str
    onset_s: float = 0.0  # where its speech starts (speech_onset_s)

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / 2 / RATE


ONSET_BELOW_PEAK_DB = 30.0  # a 10 ms piece this close to the clip's loudest is speech


def speech_onset_s(pcm: np.ndarray) -> float:
    """Where a clip's speech starts: its first 10 ms piece whose RMS is within ONSET_BELOW_PEAK_DB
    of the loudest piece's (the clips' lead-in is quiet room tone or silence)."""
    piece = RATE // 100
    n = len(pcm) // piece
    if n == 0:
        return 0.0
    rms = np.sqrt((pcm[: n * piece].astype(np.float64).reshape(n, piece) ** 2).mean(axis=1))
    loud = np.flatnonzero(rms >= rms.max() * 10 ** (-ONSET_BELOW_PEAK_DB / 20))
    return float(loud[0]) / 100 if loud.size else 0.0


@functools.cache
def load_clips(frame_ms: int = LoadConfig.frame_ms) -> tuple[Clip, ...]:
    """The shipped clips (clips/README.md), decoded once per process."""
    from engines.audio import load_audio

    frame = RATE * frame_ms // 1000
    clips = []
    for path in sorted(CLIPS_DIR.glob("*.wav")):
        audio = load_audio(path)
        pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
        pcm = np.concatenate([pcm, np.zeros(-len(pcm) % frame, "<i2")])  # whole frames: one clip per frame
        clips.append(Clip(path.stem, pcm.tobytes(), path.with_suffix(".txt").read_text().strip(), speech_onset_s(pcm)))
    if not clips:
        raise FileNotFoundError(f"no speech clips in {CLIPS_DIR}")
    return tuple(clips)


@dataclass(frozen=True)
class Turn:
    start_s: float  # from the start of the student's stream, a whole number of frames
    clip: Clip

    @property
    def end_s(self) -> float:
        return self.start_s + self.clip.duration_s


def mean_gap_s(clips: tuple[Clip, ...], speak_ratio: float) -> float:
    """Mean silence between clips for which a student speaks `speak_ratio` of the time
    (clip / (clip + gap) = ratio); at least MIN_GAP_S, which caps the reachable ratio."""
    mean_clip = sum(c.duration_s for c in clips) / len(clips)
    return max(MIN_GAP_S, mean_clip * (1 - speak_ratio) / speak_ratio)


def plan_turns(clips: tuple[Clip, ...], length_s: float, speak_ratio: float, rng: random.Random, frame_ms: int = LoadConfig.frame_ms) -> list[Turn]:
    """One student's turns over a stream of `length_s`; every clip ends at least MIN_GAP_S before
    the stream does, so its utterance is complete while the student is still connected."""
    gap = mean_gap_s(clips, speak_ratio)
    mean_clip = sum(c.duration_s for c in clips) / len(clips)
    frame_s = frame_ms / 1000
    # The plan starts a few cycles before the stream and keeps what falls inside it: students
    # then do not all start talking together, and the share speaking is speak_ratio from the
    # first second (a clip cut by the stream's start is left out: silence instead).
    t = -WARMUP_CYCLES * (mean_clip + gap) + rng.uniform(0, mean_clip + gap)
    turns: list[Turn] = []
    while True:
        clip = rng.choice(clips)
        start = round(t / frame_s) * frame_s
        if start + clip.duration_s + MIN_GAP_S > length_s:
            return turns
        if start >= 0:
            turns.append(Turn(start, clip))
        extra = rng.expovariate(1 / (gap - MIN_GAP_S)) if gap > MIN_GAP_S else 0.0
        t = start + clip.duration_s + MIN_GAP_S + extra


def render(turns: list[Turn], length_s: float) -> np.ndarray:
    """A student's whole stream as float32 audio (for clients that play a file: WebRTC)."""
    out = np.zeros(int(length_s * RATE), np.float32)
    for turn in turns:
        pcm = np.frombuffer(turn.clip.pcm, "<i2").astype(np.float32) / 32768
        at = int(round(turn.start_s * RATE))
        out[at : at + pcm.size] = pcm[: max(0, out.size - at)]
    return out
