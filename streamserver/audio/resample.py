"""Turn transport audio (aiortc's 48 kHz s16 stereo frames, or raw 16 kHz PCM) into 16 kHz mono int16."""

from __future__ import annotations

import av
import numpy as np

RATE = 16000


def _new_resampler() -> av.AudioResampler:
    # s16 output: FFmpeg averages stereo to mono for s16 (for flt it sums at 0.707 and can clip).
    return av.AudioResampler(format="s16", layout="mono", rate=RATE)


def _samples(frames: list[av.AudioFrame]) -> list[np.ndarray]:
    return [f.to_ndarray().reshape(-1) for f in frames]


_EMPTY = np.zeros(0, dtype=np.int16)


class To16kMono:
    """One per incoming track: keeps the resampler's filter state across frames, so no clicks at frame edges."""

    def __init__(self) -> None:
        self._resampler = _new_resampler()
        self._source: tuple[str, str, int] | None = None

    def push(self, frame: av.AudioFrame) -> np.ndarray:
        """Resample one frame; returns the int16 samples ready now (a few may lag in the filter)."""
        out: list[np.ndarray] = []
        source = (frame.format.name, frame.layout.name, frame.sample_rate)
        if self._source is not None and source != self._source:
            # PyAV's resampler is fixed to its first input's format: drain it and start a new one.
            out += _samples(self._resampler.resample(None))
            self._resampler = _new_resampler()
        self._source = source
        # WebRTC pts jump after packet loss/reordering; timestamp-driven resampling would then
        # pad or drop audio. Resample by sample count instead.
        frame.pts = None
        out += _samples(self._resampler.resample(frame))
        return _join(out)

    def push_pcm16(self, samples: np.ndarray) -> np.ndarray:
        """Already 16 kHz mono (e.g. WebSocket ingest): validate and pass through as int16."""
        samples = np.asarray(samples)
        if samples.ndim != 1:
            raise ValueError(f"expected 1-D mono samples, got shape {samples.shape}")
        if np.issubdtype(samples.dtype, np.floating):
            return np.clip(samples * 32768.0, -32768, 32767).astype(np.int16)  # exact inverse of /32768
        if samples.dtype != np.int16:
            raise TypeError(f"expected int16 or float samples, got {samples.dtype}")
        return np.ascontiguousarray(samples)

    def flush(self) -> np.ndarray:
        """End of track: the samples still held in the resampler's filter."""
        if self._source is None:
            return _EMPTY
        out = _join(_samples(self._resampler.resample(None)))
        self._resampler, self._source = _new_resampler(), None
        return out


def _join(chunks: list[np.ndarray]) -> np.ndarray:
    if not chunks:
        return _EMPTY
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
