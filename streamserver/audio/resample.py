"""Turn transport audio (aiortc's 48 kHz s16 stereo frames, or raw 16 kHz PCM) into 16 kHz mono int16."""

from __future__ import annotations

import numpy as np

from engines.audio import Resampler
from engines.features import SAMPLE_RATE as RATE  # noqa: F401 - the transports' sample rate, imported from here


class To16kMono(Resampler):
    """One per incoming track: PyAV frames through push() and flush() (engines.audio.Resampler),
    or PCM that is already 16 kHz mono through push_pcm16()."""

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
