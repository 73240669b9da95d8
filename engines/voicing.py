"""How much of a clip is voiced, by WebRTC's voice-activity detector.

Whisper's own no-speech gate misses the classic hallucination ("you", "Thank you.") on digital
silence and low rumble, where the model is sure of a short text. A clip in which the VAD hears
almost no voicing is not sent to the model at all: that costs ~1 ms a second of audio and also
saves the encoder pass.
"""

from __future__ import annotations

import numpy as np
import webrtcvad

from engines.features import SAMPLE_RATE

FRAME_SAMPLES = SAMPLE_RATE * 30 // 1000  # webrtcvad takes 10, 20 or 30 ms frames
AGGRESSIVENESS = 3  # the mode least likely to call noise speech


def to_pcm16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1.0, 1.0) * 32767).astype(np.int16)


def voiced_seconds(audio: np.ndarray) -> float:
    """Seconds of 30 ms frames the VAD calls speech."""
    vad = webrtcvad.Vad(AGGRESSIVENESS)
    pcm = to_pcm16(audio)
    n = pcm.size // FRAME_SAMPLES
    frames = pcm[: n * FRAME_SAMPLES].reshape(n, FRAME_SAMPLES)
    return sum(vad.is_speech(f.tobytes(), SAMPLE_RATE) for f in frames) * FRAME_SAMPLES / SAMPLE_RATE
