"""Decode any audio or video file to the 16 kHz mono float32 Whisper expects.

PyAV (bundled FFmpeg) reads whatever a teacher uploads: wav, mp3, ogg/opus,
m4a, or the audio track of a video. Every failure is reported as one
:class:`AudioError` naming the file and the reason, so the server can turn it
into a clean client error instead of a stack trace. :class:`Resampler` is the
same conversion for a live stream's frames (the server's transports use it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np

from engines.features import SAMPLE_RATE

log = logging.getLogger(__name__)


class AudioError(ValueError):
    """The file could not be turned into audio samples (message says why)."""


def _new_resampler() -> av.AudioResampler:
    # s16 rather than flt: for a float output FFmpeg's stereo->mono matrix is
    # not normalised (L and R are each weighted 0.707, so loud stereo exceeds
    # 1.0); for s16 it averages the channels. It is also what Whisper's own
    # ffmpeg pipeline produces (s16le, scaled by 1/32768).
    return av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)


def _to_samples(frames: list[av.AudioFrame]) -> list[np.ndarray]:
    return [f.to_ndarray().reshape(-1) for f in frames]


_EMPTY = np.zeros(0, dtype=np.int16)


class Resampler:
    """Frames of any rate, layout and sample format -> 16 kHz mono int16, one per stream: the
    resampler's filter state carries across frames, so there are no clicks at frame edges."""

    def __init__(self) -> None:
        self._resampler = _new_resampler()
        self._source: tuple[str, str, int] | None = None

    def push(self, frame: av.AudioFrame) -> np.ndarray:
        """Resample one frame; returns the int16 samples ready now (a few may lag in the filter)."""
        out: list[np.ndarray] = []
        source = (frame.format.name, frame.layout.name, frame.sample_rate)
        if self._source is not None and source != self._source:
            # A stream may change rate or layout midway; PyAV's resampler is fixed to its
            # first input's format, so drain it and start a new one.
            out += _to_samples(self._resampler.resample(None))
            self._resampler = _new_resampler()
        self._source = source
        # Resample by sample count, not by timestamps: WebRTC pts jump after packet loss or
        # reordering, and timestamp-driven resampling would then pad or drop audio.
        frame.pts = None
        out += _to_samples(self._resampler.resample(frame))
        return _join(out)

    def flush(self) -> np.ndarray:
        """End of stream: the samples still held in the resampler's filter."""
        if self._source is None:
            return _EMPTY
        out = _join(_to_samples(self._resampler.resample(None)))
        self._resampler, self._source = _new_resampler(), None
        return out


def _join(chunks: list[np.ndarray]) -> np.ndarray:
    if not chunks:
        return _EMPTY
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


def _decode_tolerantly(
    container: av.container.InputContainer, stream: av.AudioStream, skipped: list[int]
) -> Iterator[av.AudioFrame]:
    """Decode packet by packet, skipping corrupt ones (counted in ``skipped[0]``).

    Like the ffmpeg command line (Whisper's own loader), a damaged packet
    costs its few milliseconds of audio rather than the whole recording.
    """
    for packet in container.demux(stream):
        try:
            frames = packet.decode()
        except av.error.InvalidDataError:
            skipped[0] += 1
            continue
        yield from frames


def load_audio(path: str | os.PathLike[str]) -> np.ndarray:
    """Decode ``path`` to mono 16 kHz float32 samples in [-1, 1).

    Uses the first audio stream of the file; corrupt packets inside it are
    skipped. Raises :class:`AudioError` if the file is missing, unreadable or
    not a media file, has no audio stream, or decodes to zero samples.
    """
    path = Path(path)
    if not path.exists():
        raise AudioError(f"{path}: file not found")
    if not path.is_file():
        raise AudioError(f"{path}: not a regular file")

    chunks: list[np.ndarray] = []
    skipped: list[int] = [0]
    try:
        with av.open(str(path), mode="r") as container:
            if not container.streams.audio:
                raise AudioError(f"{path}: no audio stream in file")
            stream = container.streams.audio[0]
            resampler = Resampler()
            for frame in _decode_tolerantly(container, stream, skipped):
                chunks.append(resampler.push(frame))
            chunks.append(resampler.flush())  # the tail
    except AudioError:
        raise
    except av.error.FFmpegError as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise AudioError(f"{path}: not a readable audio/video file ({reason})") from exc
    except (OSError, ValueError, RuntimeError) as exc:
        raise AudioError(f"{path}: could not decode audio ({exc})") from exc

    pcm = _join(chunks)
    if pcm.size == 0:
        if skipped[0]:
            raise AudioError(f"{path}: audio stream is corrupt ({skipped[0]} undecodable packets, no samples)")
        raise AudioError(f"{path}: audio stream contains no samples")
    if skipped[0]:
        log.warning("%s: skipped %d corrupt packets; the rest was decoded", path, skipped[0])
    return pcm.astype(np.float32) / 32768.0
