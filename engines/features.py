"""Whisper's log-mel front end in pure numpy.

Whisper models were trained on one exact feature recipe, so the encoder only
sees in-distribution input if we reproduce it closely: a periodic Hann window
of 400 samples, a centred STFT (reflect padding) with hop 160, squared
magnitudes with the last frame dropped, Slaney-style mel filters (librosa's
defaults), ``log10(max(mel, 1e-10))``, a clamp to ``max - 8`` and finally
``(x + 4) / 4``.

Whisper always computes the mel over the audio followed by 30 s of zeros.
Frames that only see those zeros are all the same constant after the clamp, so
:func:`log_mel` runs the STFT only over the frames that touch audio and fills
the rest with that constant. That is where nearly all the time would go for a
short real-time chunk.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 80
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000

_HALF = N_FFT // 2  # centre padding of the STFT
_LOG_FLOOR = 1e-10
_DYNAMIC_RANGE = 8.0


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz * 3.0 / 200.0
    log_part = 15.0 + np.log(np.maximum(hz, 1e-12) / 1000.0) * (27.0 / np.log(6.4))
    return np.where(hz >= 1000.0, log_part, linear)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_hz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    linear = mel * 200.0 / 3.0
    log_part = 1000.0 * np.exp((mel - 15.0) * (np.log(6.4) / 27.0))
    return np.where(mel >= 15.0, log_part, linear)


@lru_cache(maxsize=None)
def mel_filterbank(
    sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS
) -> np.ndarray:
    """Slaney-normalised triangular mel filters, float32 ``[n_mels, n_fft//2+1]``.

    Matches librosa's default ``filters.mel`` (htk=False, norm='slaney'), which
    is what Whisper's bundled ``mel_filters.npz`` was made from. Computed once
    and cached; the returned array is read-only because callers share it.
    """
    fft_hz = np.linspace(0.0, sr / 2.0, n_fft // 2 + 1)
    edges_hz = _mel_to_hz(
        np.linspace(_hz_to_mel(0.0), _hz_to_mel(sr / 2.0), n_mels + 2)
    )
    lo, mid, hi = edges_hz[:-2, None], edges_hz[1:-1, None], edges_hz[2:, None]
    rising = (fft_hz - lo) / (mid - lo)
    falling = (hi - fft_hz) / (hi - mid)
    tri = np.maximum(0.0, np.minimum(rising, falling))
    tri *= 2.0 / (hi - lo)  # equal area per filter
    bank = tri.astype(np.float32)
    bank.setflags(write=False)
    return bank


@lru_cache(maxsize=None)
def _filter_bands(n_mels: int = N_MELS) -> tuple[tuple[int, int, np.ndarray], ...]:
    """Per filter: the FFT-bin range where it is non-zero and its float64 weights.

    Each triangle spans at most ~14 of the 201 bins. Applying the bands one by
    one (80 small matrix-vector products) costs a fraction of a millisecond and
    never wakes BLAS worker threads; one dense [frames, 201] x [201, 80] matmul
    does, and on a busy machine their wake-up costs more than the arithmetic.
    """
    bands = []
    for row in mel_filterbank(n_mels=n_mels):
        nonzero = np.flatnonzero(row)
        lo, hi = (int(nonzero[0]), int(nonzero[-1]) + 1) if nonzero.size else (0, 0)
        weights = row[lo:hi].astype(np.float64)
        weights.setflags(write=False)
        bands.append((lo, hi, weights))
    return tuple(bands)


@lru_cache(maxsize=None)
def _hann_window() -> np.ndarray:
    """Periodic Hann window (torch.hann_window's default), as Whisper uses."""
    n = np.arange(N_FFT, dtype=np.float64)
    win = 0.5 - 0.5 * np.cos(2.0 * np.pi * n / N_FFT)
    win.setflags(write=False)
    return win


def frames_for_seconds(seconds: float) -> int:
    """Smallest even mel-frame count that covers ``seconds`` of audio.

    The encoder's second convolution has stride 2, so frame counts are kept
    even; a window of ``frames_for_seconds(s)`` frames accepts ``s`` seconds of
    audio in :func:`log_mel`.
    """
    if not math.isfinite(seconds) or seconds < 0 or seconds > CHUNK_SECONDS:
        raise ValueError(f"seconds must be within [0, {CHUNK_SECONDS}], got {seconds}")
    n_samples = round(seconds * SAMPLE_RATE)
    frames = -(-n_samples // HOP_LENGTH)
    return max(2, frames + (frames % 2))


def as_float(audio: np.ndarray) -> np.ndarray:
    """Samples as float32 in [-1, 1]: int16 PCM (how the queue carries an utterance) scaled by
    1/32768, anything else as float32."""
    if audio.dtype == np.int16:
        out = audio.astype(np.float32)
        out *= np.float32(1 / 32768)
        return out
    return np.asarray(audio, dtype=np.float32)


def log_mel(audio: np.ndarray, n_frames: int, fill: float | None = None, n_mels: int = N_MELS) -> np.ndarray:
    """Whisper log-mel features of ``audio``, float32 ``[n_mels, n_frames]`` (80; large-v3 128).

    Equal (to float rounding) to Whisper's
    ``log_mel_spectrogram(audio, padding=N_SAMPLES)[:, :n_frames]``, but the
    STFT is only computed over frames whose window touches audio. Every other
    frame of Whisper's zero-padded signal has mel energy 0, i.e. log value
    -10, which can never exceed the log value of a frame that sees audio (those
    are floored at -10 too), so the clamp's global maximum is the maximum over
    the audio frames. That includes the one or two frames past ``n_frames``
    that still overlap the end of the audio, which are computed for the max
    and then discarded. With no samples at all the maximum is -10.

    ``audio`` is mono at 16 kHz, float32 in [-1, 1] or int16 PCM (as_float), with at most
    ``n_frames * 160`` samples; ``n_frames`` must be even (the encoder halves
    it) and at most 3000 (30 s, Whisper's context).

    ``fill`` replaces the frames after the audio (from frame ceil(n/160)+1 on) with a
    constant, as faster-whisper does with 0.0; None keeps Whisper's log-mel of silence.
    """
    if isinstance(n_frames, bool) or not isinstance(n_frames, (int, np.integer)):
        raise TypeError(f"n_frames must be an int, got {type(n_frames).__name__}")
    n_frames = int(n_frames)
    if n_frames <= 0 or n_frames % 2 or n_frames > N_FRAMES:
        raise ValueError(
            f"n_frames must be a positive even number <= {N_FRAMES}, got {n_frames}"
        )
    # Whisper works on float32 input; quantise the same way before upcasting.
    audio = as_float(audio)
    if audio.ndim != 1:
        raise ValueError(f"audio must be 1-D mono samples, got shape {audio.shape}")
    n = audio.shape[0]
    if n > n_frames * HOP_LENGTH:
        raise ValueError(
            f"audio has {n} samples ({n / SAMPLE_RATE:.3f} s) but n_frames={n_frames} "
            f"holds at most {n_frames * HOP_LENGTH} samples "
            f"({n_frames * HOP_LENGTH / SAMPLE_RATE:.3f} s)"
        )

    # Frame t covers original samples [t*160 - 200, t*160 + 200): it touches
    # audio iff t*160 - 200 < n.
    n_audio_frames = -(-(n + _HALF) // HOP_LENGTH) if n else 0
    if n_audio_frames:
        # Audio, then enough zeros (Whisper's padding) for the last frame; the
        # left reflect padding mirrors samples 1..200 of that padded signal.
        signal_len = (n_audio_frames - 1) * HOP_LENGTH + N_FFT
        padded = np.zeros(signal_len, dtype=np.float64)
        padded[_HALF : _HALF + n] = audio
        padded[:_HALF] = padded[2 * _HALF : _HALF : -1]
        frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH]
        spectrum = np.fft.rfft(frames * _hann_window(), axis=-1)
        power = spectrum.real**2 + spectrum.imag**2  # [frames, 201]
        mel = np.empty((n_mels, n_audio_frames))
        for m, (lo, hi, weights) in enumerate(_filter_bands(n_mels)):
            mel[m] = power[:, lo:hi] @ weights
        log_spec = np.log10(np.maximum(mel, _LOG_FLOOR))
        top = float(log_spec.max())
    else:
        log_spec = np.empty((n_mels, 0))
        top = math.log10(_LOG_FLOOR)

    floor = top - _DYNAMIC_RANGE
    pad_value = (max(math.log10(_LOG_FLOOR), floor) + 4.0) / 4.0
    out = np.full((n_mels, n_frames), pad_value, dtype=np.float32)
    keep = min(n_audio_frames, n_frames)
    out[:, :keep] = (np.maximum(log_spec[:, :keep], floor) + 4.0) / 4.0
    if fill is not None:
        out[:, -(-n // HOP_LENGTH) + 1 :] = fill
    return out
