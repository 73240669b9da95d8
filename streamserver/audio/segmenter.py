"""Cut a student's 16 kHz mono PCM stream into utterances with webrtcvad.

Every frame is stamped with the server clock at the feed() call that completed it, so an
utterance's ``end_of_speech_ts`` is when its last voiced audio *arrived*, not when the
hangover later expired: latency measured from it includes the VAD's own wait.
"""

from __future__ import annotations

import math
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import webrtcvad

from engines.features import SAMPLE_RATE
from streamserver.events import now

START_WINDOW = 5  # frames looked at to decide that speech started
CUT_SEARCH_S = 1.0  # how far back from the max length to look for a pause to cut at
# webrtcvad keeps answering "voiced" for 4 (mode 2-3) to 6 (mode 0-1) 30 ms frames after any
# sound stops, so a single click looks like 5 voiced frames and every end of speech comes
# 120 ms late; it also calls steady noise "speech" for seconds after real speech. A voiced
# frame therefore only counts as speech if it is clearly above the room's noise floor.
SPEECH_OVER_FLOOR = 2.0  # 6 dB
FLOOR_RISE = 0.005  # per frame: the floor drops at once to a quieter frame, rises over ~6 s
DIGITAL_SILENCE = 8  # |sample| <= this (-72 dBFS) throughout the frame
# What `--vad-hangover-ms` accepts: much below ~250 ms the pauses inside a read sentence end it
# (figures in benchmarks/README.md); above 2 s a student waits too long for the transcript.
HANGOVER_MS_RANGE = (250, 2000)
NO_SAMPLES = np.zeros(0, dtype=np.int16)
NO_SAMPLES.flags.writeable = False


@dataclass
class SegmenterConfig:
    aggressiveness: int = 2  # webrtcvad 0..3, higher rejects more noise
    frame_ms: int = 30  # webrtcvad accepts 10, 20 or 30
    pre_roll_ms: int = 300  # kept before the first voiced frame: VAD misses soft onsets
    # kept after the last voiced frame: VAD misses soft word endings. 200 rather than 300 ms: the
    # speculative final starts once a pause has lasted this, so a slow CPU has 300 ms of the 500 ms
    # hangover to recognise it (tiny.en takes 200-260 ms there); no transcript is worse for it
    # (benchmarks/post_roll.py; benchmarks/README.md, "VAD post-roll")
    post_roll_ms: int = 200
    hangover_ms: int = 500  # this much silence ends an utterance
    min_speech_ms: int = 250  # utterances with less voiced audio are clicks/coughs: dropped
    max_utterance_s: float = 20.0  # longer speech is cut into pieces, each emitted
    start_frames: int = 3  # voiced frames out of the last START_WINDOW needed to start
    # Hints (SpeechTaker.speech_so_far), best effort, while a student speaks: every this much new voiced audio, the
    # utterance so far ("partial"; 0: none; the first one after half of it: the teacher sees
    # who speaks, and about what, soonest) ...
    partial_interval_ms: int = 0
    # ... and, once a pause has lasted the post-roll, the utterance as the hangover would end it
    # there ("speculative"): the same samples, so its transcript can be ready when the pause is
    # confirmed. Needs post_roll_ms < hangover_ms.
    speculate: bool = True

    def __post_init__(self) -> None:
        if self.frame_ms not in (10, 20, 30):
            raise ValueError("webrtcvad frames must be 10, 20 or 30 ms")
        if not 1 <= self.start_frames <= START_WINDOW:
            raise ValueError(f"start_frames must be 1..{START_WINDOW}")
        if self.post_roll_ms > self.hangover_ms:
            raise ValueError("post_roll_ms cannot exceed hangover_ms")

    @classmethod
    def with_hangover(cls, hangover_ms: int) -> SegmenterConfig:
        """The defaults with another hangover; the post-roll is shortened to fit a shorter one."""
        return cls(hangover_ms=hangover_ms, post_roll_ms=min(cls.post_roll_ms, hangover_ms))


@dataclass
class SegmentedSpeech:
    audio: np.ndarray  # float32 mono 16 kHz in [-1, 1]
    start_ts: float  # arrival of the first voiced frame
    end_of_speech_ts: float  # arrival of the last voiced frame (before the hangover)
    cut: bool = False  # ended by max_utterance_s rather than by a pause
    key: str = ""  # the same for an utterance's hints and its final
    kind: str = "final"  # or "partial", "speculative" (SegmenterConfig)
    revision: int = 0  # partials of this utterance so far
    first_sample: int = 0  # where `audio` starts in the stream fed (samples since the first feed)

    @property
    def duration_s(self) -> float:
        return len(self.audio) / SAMPLE_RATE


class SpeechTaker(Protocol):
    """Where the VAD hands what it cuts (audio/pipeline.py StudentAudio): inside stage 2 of
    stages.py."""

    def speech(self, speech: SegmentedSpeech) -> None:
        """A finished utterance (or a piece cut at the maximum length)."""

    def speech_so_far(self, speech: SegmentedSpeech) -> None:
        """The utterance in progress so far: a partial or a speculative hint."""


class UtteranceSegmenter:
    """Not thread-safe: one per student stream, fed from one task."""

    def __init__(
        self,
        config: SegmenterConfig | None = None,
        out: SpeechTaker | None = None,
        clock: Callable[[], float] = now,
    ) -> None:
        self.config = c = config or SegmenterConfig()
        self.out = out  # where each cut goes; None: nowhere
        self._clock = clock
        self._vad = webrtcvad.Vad(c.aggressiveness)
        self._n = SAMPLE_RATE * c.frame_ms // 1000  # samples per frame
        frames = lambda ms: math.ceil(ms / c.frame_ms)  # noqa: E731
        self._pre_roll = frames(c.pre_roll_ms)
        self._post_roll = frames(c.post_roll_ms)
        self._hangover = max(1, frames(c.hangover_ms))
        self._min_voiced = frames(c.min_speech_ms)
        self._max_frames = max(1, int(c.max_utterance_s * 1000) // c.frame_ms)
        self._cut_search = max(1, frames(CUT_SEARCH_S * 1000))
        self._partial_every = frames(c.partial_interval_ms) if c.partial_interval_ms > 0 else 0
        self._speculate = c.speculate and self._post_roll < self._hangover
        self._pending = NO_SAMPLES  # partial frame carried to the next feed()
        self._zeros = np.zeros(self._n, dtype=np.int16)  # every all-zero frame the ring holds
        self._zeros.flags.writeable = False
        self._frame_no = 0  # frames processed so far: the stream position of the newest one + 1
        self._floor: float | None = None  # noise floor, RMS in int16 units
        # Idle: the last frames as (pcm, voiced, arrival_ts), for pre-roll and the start decision.
        self._ring: deque[tuple[np.ndarray, bool, float]] = deque(maxlen=self._pre_roll + START_WINDOW)
        self._reset_utterance()

    def _reset_utterance(self) -> None:
        self._triggered = False
        self._frames: list[np.ndarray] = []
        self._voiced: list[bool] = []
        self._ts: list[float] = []
        self._voiced_count = 0
        self._last_voiced = -1  # index into _frames
        self._silence = 0  # unvoiced frames since the last voiced one
        self._continued = False  # this piece follows a max-length cut
        self._key = uuid.uuid4().hex
        self._revision = 0
        self._next_partial = max(1, self._partial_every // 2)  # voiced frames

    @property
    def in_utterance(self) -> bool:
        """An utterance is open: speech, or the hangover after it (its end waits for silence)."""
        return self._triggered

    @property
    def speaking(self) -> bool:
        """For the dashboard: only once the speech is long enough not to be a click or cough."""
        return self._triggered and (self._continued or self._voiced_count >= self._min_voiced)

    @property
    def safe_sample(self) -> int:
        """The stream position before which no audio can become part of a future utterance: the
        start of the utterance being spoken, else of the frames kept for a pre-roll. Audio before
        it is either in an emitted utterance or was not speech."""
        held = len(self._frames) if self._triggered else len(self._ring)
        return (self._frame_no - held) * self._n

    def feed(self, pcm16: np.ndarray, ts: float | None = None) -> None:
        """Any length of 16 kHz mono int16 (float in [-1, 1] is converted). `ts`: when it was
        captured on the server clock, if not now (audio a client kept and sends late)."""
        pcm16 = np.asarray(pcm16)
        if pcm16.dtype.kind == "f":
            pcm16 = np.clip(pcm16 * 32768.0, -32768, 32767).astype(np.int16)  # exact inverse of /32768
        ts = self._clock() if ts is None else ts
        data = pcm16.reshape(-1).astype(np.int16, copy=False)
        if self._pending.size:
            data = np.concatenate((self._pending, data))
        whole = len(data) // self._n * self._n
        rest = data[whole:]
        self._pending = rest.copy() if rest.size else NO_SAMPLES
        # Most of a class is silent most of the time, and its clients send silence as digital
        # zeros (a muted microphone too): while no utterance is open such a message is one scan,
        # its frames one shared frame of zeros in the ring (nothing of it can start speech).
        if not self._triggered and not np.count_nonzero(data[:whole]):
            count = whole // self._n
            self._frame_no += count
            self._ring.extend([(self._zeros, False, ts)] * count)
            return
        frames = np.array(data[:whole]).reshape(-1, self._n)  # a copy: frames outlive the caller's buffer
        for frame, sound in zip(frames, frames.any(axis=1).tolist()):
            self._process(frame, sound and self._is_speech(frame), ts)

    def _is_speech(self, frame: np.ndarray) -> bool:
        """Whether a frame with some sound in it (not all zeros) is speech."""
        f = frame.astype(np.float32)
        level = math.sqrt(float(f @ f) / self._n)
        # muted: keep it away from the VAD's and our noise estimates (a level above the bound
        # already says some sample is: the two scans only for quiet frames)
        if level <= DIGITAL_SILENCE and frame.max() <= DIGITAL_SILENCE and frame.min() >= -DIGITAL_SILENCE:
            return False
        floor = self._floor if self._floor is not None else level
        # minimum tracking: follows the quietest recent frames (the room), not the voice
        self._floor = level if level < floor else floor + FLOOR_RISE * (level - floor)
        voiced = self._vad.is_speech(frame.tobytes(), SAMPLE_RATE)  # always: the VAD adapts on every frame
        return voiced and level >= SPEECH_OVER_FLOOR * floor

    def flush(self) -> None:
        """End of stream (or forced boundary): emit pending speech if long enough, then reset."""
        if self._triggered:
            self._end()
        self.discard()

    def discard(self) -> None:
        """Forget the speech in progress without emitting it (its client sends it again)."""
        if self._triggered:  # the stream position stays: later audio continues the stream
            self._reset_utterance()
        self._pending = NO_SAMPLES  # < 1 frame: too short for the VAD anyway
        self._ring.clear()

    def _process(self, frame: np.ndarray, voiced: bool, ts: float) -> None:
        self._frame_no += 1
        if not self._triggered:
            self._ring.append((frame, voiced, ts))
            # only a voiced frame can bring the window to start_frames (it was below before)
            if voiced and sum(v for _, v, _ in list(self._ring)[-START_WINDOW:]) >= self.config.start_frames:
                self._start()
            return
        self._frames.append(frame)
        self._voiced.append(voiced)
        self._ts.append(ts)
        if voiced:
            self._voiced_count += 1
            self._last_voiced = len(self._frames) - 1
            self._silence = 0
        else:
            self._silence += 1
        if self._silence >= self._hangover:
            self._end()
        elif len(self._frames) >= self._max_frames:
            self._cut()
        elif voiced and self._partial_every and self._voiced_count >= self._next_partial:
            self._next_partial = self._voiced_count + self._partial_every
            self._revision += 1
            self._hint(len(self._frames), "partial")
        elif self._speculate and self._silence == self._post_roll and self._last_voiced >= 0:
            # exactly what _end() will keep if no voice comes back: frames up to here. It counts as
            # a revision: its text is shown as the newest caption when it is ready first.
            self._revision += 1
            self._hint(len(self._frames), "speculative")

    def _start(self) -> None:
        ring = list(self._ring)
        self._ring.clear()
        first_voiced = next(i for i in range(len(ring) - START_WINDOW, len(ring)) if i >= 0 and ring[i][1])
        self._triggered = True
        self._load(ring[max(0, first_voiced - self._pre_roll) :])

    def _load(self, entries: list[tuple[np.ndarray, bool, float]]) -> None:
        """Make ``entries`` the start of the current piece (after a start or a cut)."""
        self._frames = [f for f, _, _ in entries]
        self._voiced = [v for _, v, _ in entries]
        self._ts = [t for _, _, t in entries]
        self._voiced_count = sum(self._voiced)
        voiced_at = [i for i, v in enumerate(self._voiced) if v]
        self._last_voiced = voiced_at[-1] if voiced_at else -1
        if voiced_at:
            self._silence = len(self._frames) - 1 - self._last_voiced
        # else: no voice yet in this piece, the silence run carries over from the previous piece

    def _end(self) -> None:
        keep = self._last_voiced + 1 + self._post_roll if self._last_voiced >= 0 else 0
        self._emit(keep, cut=False)
        # Unemitted hangover frames can be the pre-roll of a quick restart.
        rest = list(zip(self._frames[keep:], self._voiced[keep:], self._ts[keep:]))
        self._reset_utterance()
        self._ring.extend(rest)

    def _cut(self) -> None:
        # Prefer the last pause in the final second, so a word is not split between pieces.
        lo = max(1, len(self._frames) - self._cut_search)
        at = next((i + 1 for i in range(len(self._frames) - 1, lo - 1, -1) if not self._voiced[i]), len(self._frames))
        self._emit(at, cut=True)
        rest = list(zip(self._frames[at:], self._voiced[at:], self._ts[at:]))
        silence = self._silence
        self._reset_utterance()
        self._triggered = self._continued = True
        self._silence = silence
        self._load(rest)

    def _emit(self, upto: int, cut: bool) -> None:
        if (speech := self._speech(upto, cut)) and self.out is not None:
            self.out.speech(speech)

    def _hint(self, upto: int, kind: str) -> None:
        if self.out is not None and (speech := self._speech(upto, False, kind)):
            self.out.speech_so_far(speech)

    def _speech(self, upto: int, cut: bool, kind: str = "final") -> SegmentedSpeech | None:
        """The first `upto` frames of this piece, if they hold enough voice to be an utterance."""
        upto = min(upto, len(self._frames))
        # list methods, not a loop: a partial of a long utterance looks at hundreds of frames
        voiced = self._voiced[:upto]
        count = voiced.count(True)
        long_enough = count >= self._min_voiced or (self._continued and count)
        if not count or not long_enough:
            return None
        first, last = voiced.index(True), upto - 1 - voiced[::-1].index(True)
        audio = np.concatenate(self._frames[:upto]).astype(np.float32) / 32768.0
        first_sample = (self._frame_no - len(self._frames)) * self._n
        return SegmentedSpeech(audio, self._ts[first], self._ts[last], cut, self._key, kind, self._revision,
                               first_sample)
