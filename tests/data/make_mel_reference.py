"""Regenerate ``mel_reference_librivox_0870.npy`` from openai-whisper itself.

The stored array is the ground truth that ``tests/test_features.py`` checks our
numpy front end (``engines.features.log_mel``) against. This script needs
``openai-whisper`` and ``torch`` installed in a *separate* virtual environment
(they are not dependencies of streamserver) and is NOT run by the tests:

    python3 -m venv /tmp/refenv
    /tmp/refenv/bin/pip install torch==2.13.0 openai-whisper
    /tmp/refenv/bin/python tests/data/make_mel_reference.py
"""

import wave
from pathlib import Path

import numpy as np
import whisper.audio

HERE = Path(__file__).resolve().parent
CLIP = HERE / "librivox" / "librivox_0870.wav"
OUT = HERE / "mel_reference_librivox_0870.npy"


def main() -> None:
    with wave.open(str(CLIP), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    audio = pcm.astype(np.float32) / 32768.0  # same scaling as whisper.audio.load_audio
    mel = whisper.audio.log_mel_spectrogram(audio, padding=whisper.audio.N_SAMPLES)
    ref = mel[:, : whisper.audio.N_FRAMES].numpy().astype(np.float32)
    np.save(OUT, ref)
    print(f"wrote {OUT} shape={ref.shape} min={ref.min():.4f} max={ref.max():.4f}")


if __name__ == "__main__":
    main()
