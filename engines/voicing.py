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
    """int16 PCM as webrtcvad takes it; PCM16 already (a queued utterance) as it is."""
    if audio.dtype == np.int16:
        return audio
    return (np.clip(audio, -1.0, 1.0) * 32767).astype(np.int16)


def has_voicing(audio: np.ndarray, min_seconds: float) -> bool:
    """At least min_seconds of 30 ms frames the VAD calls speech. Stops at the first min_seconds
    found, so speech costs a fraction of a millisecond whatever its length: on the GPU path the
    host runs this for every utterance of a batch, and must not take longer than the GPU."""
    vad = webrtcvad.Vad(AGGRESSIVENESS)
    needed = min_seconds * SAMPLE_RATE / FRAME_SAMPLES
    found = 0
    usable = audio.size - audio.size % FRAME_SAMPLES
    # Converted a chunk at a time, so that an early answer does not pay for converting the whole clip.
    for chunk_start in range(0, usable, _CHUNK):
        pcm = to_pcm16(audio[chunk_start : min(chunk_start + _CHUNK, usable)])
        for start in range(0, pcm.size, FRAME_SAMPLES):
            found += vad.is_speech(pcm[start : start + FRAME_SAMPLES].tobytes(), SAMPLE_RATE)
            if found >= needed:
                return True
    return False


_CHUNK = FRAME_SAMPLES * 10
