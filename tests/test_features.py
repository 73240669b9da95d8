"""engines.features.log_mel against openai-whisper's own log_mel_spectrogram.

The reference array was made by tests/data/make_mel_reference.py (whisper +
torch in a separate venv); these tests need neither.
"""

import wave
from pathlib import Path

import numpy as np
import pytest

from engines.features import (
    HOP_LENGTH,
    N_FRAMES,
    N_MELS,
    N_SAMPLES,
    as_float,
    frames_for_seconds,
    log_mel,
    mel_filterbank,
)

DATA = Path(__file__).parent / "data"
CLIP = DATA / "librivox" / "librivox_0870.wav"
REFERENCE = DATA / "mel_reference_librivox_0870.npy"
TOLERANCE = 1e-4  # float64 numpy vs float32 torch; measured ~1.2e-5


def read_wav(path: Path) -> np.ndarray:
    with wave.open(str(path), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return pcm.astype(np.float32) / 32768.0


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    return read_wav(CLIP)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    ref = np.load(REFERENCE)
    assert ref.shape == (N_MELS, N_FRAMES) and ref.dtype == np.float32
    return ref


def test_full_window_matches_whisper(clip, reference):
    mel = log_mel(clip, N_FRAMES)
    assert mel.shape == (N_MELS, N_FRAMES) and mel.dtype == np.float32
    assert np.abs(mel - reference).max() < TOLERANCE


# 710 frames hold the 7.1 s clip exactly: the two frames past the window that
# still overlap its last samples must count towards the clamp's maximum.
@pytest.mark.parametrize("n_frames", [710, 712, 1000, 1500, 2998])
def test_short_window_is_reference_prefix(clip, reference, n_frames):
    mel = log_mel(clip, n_frames)
    assert mel.shape == (N_MELS, n_frames)
    assert np.abs(mel - reference[:, :n_frames]).max() < TOLERANCE


def test_padding_frames_are_one_constant(clip, reference):
    mel = log_mel(clip, N_FRAMES)
    tail = mel[:, len(clip) // HOP_LENGTH + 2 :]
    assert np.all(tail == tail[0, 0])
    assert tail[0, 0] == pytest.approx(float(reference[:, -1].max()), abs=TOLERANCE)


def test_loud_end_counts_towards_clamp_max():
    # A burst in the very last samples is strongest in frames past n_frames.
    rng = np.random.default_rng(1)
    audio = np.zeros(300 * HOP_LENGTH, dtype=np.float32)
    audio[-40:] = rng.uniform(-1, 1, 40)
    audio[:8000] = rng.uniform(-1e-3, 1e-3, 8000)
    np.testing.assert_array_equal(log_mel(audio, 300), log_mel(audio, N_FRAMES)[:, :300])


@pytest.mark.parametrize("n_samples", [0, 1, 16000, N_SAMPLES])
def test_all_zero_audio(n_samples):
    # Whisper: every mel is 0 -> log10(1e-10) = -10 -> (-10 + 4) / 4.
    mel = log_mel(np.zeros(n_samples, dtype=np.float32), N_FRAMES)
    assert mel.shape == (N_MELS, N_FRAMES)
    assert np.all(mel == np.float32(-1.5))


def test_single_sample():
    mel = log_mel(np.array([0.5], dtype=np.float32), 2)
    assert mel.shape == (N_MELS, 2) and np.isfinite(mel).all()


def test_too_long_audio_raises():
    with pytest.raises(ValueError, match="samples"):
        log_mel(np.zeros(1500 * HOP_LENGTH + 1, dtype=np.float32), 1500)
    with pytest.raises(ValueError):
        log_mel(np.zeros(N_SAMPLES + 1, dtype=np.float32), N_FRAMES)


@pytest.mark.parametrize("n_frames", [0, -2, 1501, 3002])
def test_bad_n_frames_raises(n_frames):
    with pytest.raises(ValueError, match="n_frames"):
        log_mel(np.zeros(10, dtype=np.float32), n_frames)


def test_non_mono_raises():
    with pytest.raises(ValueError, match="1-D"):
        log_mel(np.zeros((2, 100), dtype=np.float32), 2)


def test_filterbank_is_cached_slaney():
    bank = mel_filterbank()
    assert bank is mel_filterbank()
    assert bank.shape == (N_MELS, 201) and bank.dtype == np.float32
    assert not bank.flags.writeable
    # Slaney norm: each triangle has area 2 / bandwidth -> peaks shrink with frequency.
    assert (bank >= 0).all() and bank[0].max() > bank[-1].max()


@pytest.mark.parametrize(
    "seconds,frames", [(0, 2), (0.005, 2), (0.01, 2), (0.011, 2), (0.021, 4), (5, 500), (7.1, 710), (29.99, 3000), (30, 3000)]
)
def test_frames_for_seconds(seconds, frames):
    assert frames_for_seconds(seconds) == frames


def test_frames_for_seconds_out_of_range():
    for bad in (-1, 30.01, float("nan")):
        with pytest.raises(ValueError):
            frames_for_seconds(bad)


def test_fill_replaces_only_frames_after_the_audio(clip):
    audio = clip[: 16000 * 3]
    whisper = log_mel(audio, 1000)
    zero = log_mel(audio, 1000, fill=0.0)
    after = 3 * 100 + 1  # frames 0..300 see audio
    np.testing.assert_array_equal(zero[:, :after], whisper[:, :after])
    assert np.all(zero[:, after:] == 0.0)
    assert np.all(whisper[:, after + 2 :] < -0.5)  # silence: the window reaches 2 frames past the audio


def test_pcm16_gives_the_log_mel_and_the_voicing_of_its_float32(clip):
    """Queued utterances reach the engines as int16 PCM: the same features and the same voicing
    gate as the same samples in float32."""
    from engines.voicing import has_voicing

    pcm = np.round(clip * 32767).astype(np.int16)
    scaled = as_float(pcm)
    assert scaled.dtype == np.float32 and np.array_equal(scaled, pcm.astype(np.float32) / np.float32(32768))
    for fill in (None, 0.0):
        assert np.array_equal(log_mel(pcm, N_FRAMES, fill), log_mel(scaled, N_FRAMES, fill))
    silence = np.zeros(16000, np.int16)
    for audio in (pcm, silence):
        assert has_voicing(audio, 0.2) == has_voicing(as_float(audio), 0.2)
    assert has_voicing(pcm, 0.2) and not has_voicing(silence, 0.2)
