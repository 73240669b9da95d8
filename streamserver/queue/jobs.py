"""An Utterance as the fields of a stream entry, and back. Audio travels as 16-bit PCM: half
the bytes of float32, and the VAD worked on PCM16 anyway."""

from __future__ import annotations

import json

import numpy as np

from streamserver.events import Utterance

_TEXT_FIELDS = ("utterance_id", "room_id", "student_id", "student_name", "language")


class JobError(ValueError):
    """A stream entry that is not a job this version can read."""


def pcm16(audio: np.ndarray) -> bytes:
    if audio.dtype == np.int16:  # a queued utterance's own samples
        return audio.astype("<i2", copy=False).tobytes()
    return (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def pcm_audio(pcm: bytes) -> np.ndarray:
    """A job's samples as the int16 PCM they are, read-only and not copied: the engines take
    PCM16 as it is (engines/features.py as_float), so the worker's event loop converts nothing,
    and a GPU engine sends half the bytes of float32."""
    return np.frombuffer(pcm, "<i2")


def encode_job(u: Utterance) -> dict[str, bytes | str]:
    pcm = pcm16(u.audio)
    fields: dict[str, bytes | str] = {name: getattr(u, name) for name in _TEXT_FIELDS}
    fields.update(start_ts=repr(u.start_ts), end_of_speech_ts=repr(u.end_of_speech_ts), cut="1" if u.cut else "0", audio=pcm)
    if u.digest:
        fields["digest"] = u.digest
    if u.source:
        fields["source"] = u.source
    if u.stream_span is not None:
        fields["stream_span"] = f"{u.stream_span[0]!r},{u.stream_span[1]!r}"
        fields["recovered"] = "1" if u.recovered else "0"
        fields["stream_clock"] = u.stream_clock
    return fields


def decode_job(fields: dict[bytes, bytes]) -> Utterance:
    try:
        text = {name: fields[name.encode()].decode() for name in _TEXT_FIELDS}
        audio = pcm_audio(fields[b"audio"])
        return Utterance(
            audio=audio,
            start_ts=float(fields[b"start_ts"]),
            end_of_speech_ts=float(fields[b"end_of_speech_ts"]),
            cut=fields[b"cut"] == b"1",
            digest=fields.get(b"digest", b"").decode(),  # absent in jobs of older gateways
            stream_span=_span(fields.get(b"stream_span")),
            recovered=fields.get(b"recovered") == b"1",
            stream_clock=fields.get(b"stream_clock", b"").decode(),
            source=fields.get(b"source", b"").decode(),
            **text,
        )
    except (KeyError, ValueError, UnicodeDecodeError) as error:
        raise JobError(f"not an utterance job: {error!r}") from error


def _span(value: bytes | None) -> tuple[float, float] | None:
    if not value:
        return None
    start, end = value.split(b",")
    return float(start), float(end)


def pack_hint_head(u: Utterance) -> bytes:
    """A hint (a partial or speculative Utterance) without its audio: its sample count, ':',
    then its fields as JSON. The audio travels apart (a hint's is a prefix of the next one's)."""
    head = {name: getattr(u, name) for name in _TEXT_FIELDS}
    head.update(start_ts=u.start_ts, end_of_speech_ts=u.end_of_speech_ts, kind=u.kind, revision=u.revision, digest=u.digest)
    return f"{u.audio.size}:".encode() + json.dumps(head).encode()


def unpack_hint(head: bytes, pcm: bytes) -> Utterance:
    """A hint from its head (pack_hint_head) and the PCM16 of its utterance from the start: at
    least its sample count (JobError for less: the audio expired)."""
    samples, _, fields = head.partition(b":")
    try:
        n = int(samples)
        hint = json.loads(fields)
    except ValueError as error:
        raise JobError(f"not a hint: {error!r}") from error
    if len(pcm) < 2 * n:
        raise JobError(f"the hint's audio holds {len(pcm) // 2} of its {n} samples (expired?)")
    try:
        return Utterance(audio=pcm_audio(pcm[: 2 * n]), **hint)
    except TypeError as error:
        raise JobError(f"not a hint: {error!r}") from error
