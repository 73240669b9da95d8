"""streamserver.audio: To16kMono and UtteranceSegmenter on real LibriVox speech.

The segmenter runs on a fake clock driven by the samples fed (20 ms chunks, like WebRTC),
so every timestamp assertion is exact in stream time.
"""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from engines.audio import load_audio
from streamserver.audio.resample import To16kMono
from streamserver.audio.segmenter import SegmentedSpeech, SegmenterConfig, UtteranceSegmenter

RATE = 16000
CLIPS = sorted((Path(__file__).parent / "data" / "librivox").glob("*.wav"))
CFG = SegmenterConfig()
HANGOVER = CFG.hangover_ms / 1000
ROLL = (CFG.pre_roll_ms + CFG.post_roll_ms) / 1000


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    return [load_audio(p) for p in CLIPS]


def room(seconds: float, seed: int = 0, level: float = 0.001) -> np.ndarray:
    """Room noise (default -60 dBFS, what browser noise suppression leaves), not digital zeros."""
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * level).astype(np.float32)


def q16(audio: np.ndarray) -> np.ndarray:
    """What the segmenter stores: int16, as feed() converts it."""
    return np.clip(np.round(audio * 32768), -32768, 32767).astype(np.int16)


class Stream:
    """Feeds 20 ms chunks; the clock is the arrival time of the chunk's last sample."""

    def __init__(self, config: SegmenterConfig = CFG) -> None:
        self.fed = 0
        self.got: list[SegmentedSpeech] = []
        self.emitted_at: list[float] = []
        self.seg = UtteranceSegmenter(config, self, clock=lambda: self.fed / RATE)

    def speech(self, u: SegmentedSpeech) -> None:  # the segmenter's SpeechTaker
        self.got.append(u)
        self.emitted_at.append(self.fed / RATE)

    def speech_so_far(self, u: SegmentedSpeech) -> None:
        pass

    def feed(self, audio: np.ndarray, chunk: int = 320) -> None:
        pcm = q16(audio)
        for i in range(0, len(pcm), chunk):
            self.fed += len(pcm[i : i + chunk])
            self.seg.feed(pcm[i : i + chunk])


@pytest.mark.parametrize("noise", [0.001, 0.01])  # -60 dBFS, and a noisy -40 dBFS room
def test_two_clips_give_two_utterances(clips: list[np.ndarray], noise: float) -> None:
    a, b = clips[0], clips[1]
    s = Stream()
    s.feed(room(1.0, 1, noise))
    s.feed(a + room(len(a) / RATE, 4, noise))
    assert s.seg.speaking and not s.got  # still inside the utterance: hangover not over
    s.feed(room(1.5, 2, noise))
    assert not s.seg.speaking and len(s.got) == 1
    s.feed(b + room(len(b) / RATE, 5, noise))
    s.feed(room(1.5, 3, noise))
    assert len(s.got) == 2 and not s.seg.speaking
    for u, clip, begin in zip(s.got, (a, b), (1.0, 2.5 + len(a) / RATE)):
        assert u.audio.dtype == np.float32 and np.abs(u.audio).max() <= 1.0
        assert not u.cut
        # The clips carry their own 0-0.3 s of room tone; pre/post roll add up to 0.6 s.
        assert abs(u.duration_s - len(clip) / RATE) <= ROLL
        assert begin - 0.05 <= u.start_ts <= begin + 0.4


def test_end_of_speech_is_arrival_of_last_voiced_audio(clips: list[np.ndarray]) -> None:
    # A clip cut off mid-word: the true end of speech is exact.
    speech = clips[3][: int(3.0 * RATE)]
    assert np.sqrt(np.mean(speech[-800:] ** 2)) > 0.02  # really speaking at the cut
    s = Stream()
    s.feed(room(1.0, 4))
    s.feed(speech)
    s.feed(room(2.0, 5))
    (u,) = s.got
    assert abs(u.end_of_speech_ts - 4.0) <= 0.1
    # emitted only when the hangover ran out, about hangover_ms after the speech arrived
    assert HANGOVER - 0.05 <= s.emitted_at[0] - u.end_of_speech_ts <= HANGOVER + 0.1


def speech_end(clip: np.ndarray) -> float:
    """Independent of any VAD: the end of the last 10 ms that is ~10 dB above the recording's
    own room tone (its quietest 10 %), in seconds into the clip."""
    rms = np.sqrt(np.mean(clip[: len(clip) // 160 * 160].reshape(-1, 160) ** 2, axis=1))
    return (np.flatnonzero(rms > 3 * np.quantile(rms, 0.1))[-1] + 1) * 0.01


def test_end_of_speech_at_natural_clip_ends(clips: list[np.ndarray]) -> None:
    for i, clip in enumerate(clips):
        s = Stream()
        s.feed(room(1.0, 10 + i))
        s.feed(clip)
        s.feed(room(1.0, 20 + i))
        (u,) = s.got
        true_end = 1.0 + speech_end(clip)
        assert abs(u.end_of_speech_ts - true_end) <= 0.1, (CLIPS[i].name, u.end_of_speech_ts, true_end)
        assert s.emitted_at[0] - u.end_of_speech_ts == pytest.approx(HANGOVER, abs=0.05)


def monologue(clips: list[np.ndarray], seconds: float) -> np.ndarray:
    """Clips back to back with 100 ms gaps, trimmed to their voiced span (their own edge
    silence plus the gap would otherwise be a pause longer than the hangover)."""
    parts: list[np.ndarray] = []
    total, k = 0, 0
    while total < seconds * RATE:
        clip = clips[k % len(clips)]
        env = np.sqrt(np.mean(clip[: len(clip) // 160 * 160].reshape(-1, 160) ** 2, axis=1))
        loud = np.flatnonzero(env > env.max() * 0.1)  # -20 dB of the clip's peak
        parts += [clip[loud[0] * 160 : (loud[-1] + 1) * 160], room(0.1, 30 + k)]
        total += len(parts[-2]) + len(parts[-1])
        k += 1
    return np.concatenate(parts)[: int(seconds * RATE)]


def test_long_monologue_is_cut_not_dropped(clips: list[np.ndarray]) -> None:
    speech = monologue(clips, 45.0)
    signal = np.concatenate([room(1.0, 40), speech, room(1.5, 41)])
    s = Stream()
    s.feed(signal)
    assert len(s.got) >= 3
    assert all(u.duration_s <= CFG.max_utterance_s for u in s.got)
    assert [u.cut for u in s.got] == [True] * (len(s.got) - 1) + [False]
    # The pieces are contiguous input audio: together they are one slice of the stream...
    emitted = q16(np.concatenate([u.audio for u in s.got]))
    pcm = q16(signal)
    starts = [i for i in range(0, len(pcm) - len(emitted), 480) if np.array_equal(pcm[i : i + 480], emitted[:480])]
    assert len(starts) == 1
    assert np.array_equal(pcm[starts[0] : starts[0] + len(emitted)], emitted)
    # ...that covers all the speech
    assert starts[0] / RATE <= 1.0 and (starts[0] + len(emitted)) / RATE >= 46.0
    # and the pieces' timestamps are in order
    for prev, nxt in zip(s.got, s.got[1:]):
        assert prev.start_ts < prev.end_of_speech_ts <= nxt.start_ts < nxt.end_of_speech_ts


def test_silence_and_clicks_give_nothing(clips: list[np.ndarray]) -> None:
    s = Stream()
    s.feed(room(5.0, 50))
    s.feed(np.zeros(RATE * 2, dtype=np.float32))
    click = room(1.0, 51)
    click[8000:8080] += np.hanning(80) * 0.9  # a 5 ms snap
    s.feed(click)
    # a 150 ms scrap of real speech (a cough-length sound): voiced, but below min_speech_ms
    s.feed(np.concatenate([clips[2][RATE : RATE + 2400] + room(0.15, 52), room(1.0, 53)]))
    # and the two within the hangover of each other
    s.feed(np.concatenate([click, clips[2][RATE : RATE + 2400] + room(0.15, 54), room(1.0, 55)]))
    s.seg.flush()
    assert s.got == [] and not s.seg.speaking


@pytest.mark.parametrize("noise", [0.001, 0.01])
def test_mute_then_unmute_gives_nothing(clips: list[np.ndarray], noise: float) -> None:
    # A muted track arrives as digital zeros; the same room's noise after unmuting is not speech
    # (fed to webrtcvad, the zeros make it call that noise speech for seconds).
    s = Stream()
    for i in range(2):
        s.feed(room(2.0, 80 + i, noise))
        s.feed(np.zeros(RATE * 2, dtype=np.float32))
        s.feed(room(3.0, 82 + i, noise))
    assert s.got == []
    s.feed(clips[2] + room(len(clips[2]) / RATE, 84, noise))  # but speech after it is
    s.feed(room(1.0, 85, noise))
    assert len(s.got) == 1


def test_flush_mid_stream_emits_pending_speech(clips: list[np.ndarray]) -> None:
    s = Stream()
    s.feed(room(1.0, 60))
    s.feed(clips[4])
    assert s.seg.speaking and not s.got
    s.seg.flush()
    assert len(s.got) == 1 and not s.seg.speaking
    assert not s.got[0].cut and abs(s.got[0].duration_s - len(clips[4]) / RATE) <= ROLL
    # the segmenter keeps working after a flush
    s.feed(clips[1])
    s.feed(room(1.0, 61))
    assert len(s.got) == 2


def test_feed_accepts_any_chunking(clips: list[np.ndarray]) -> None:
    signal = np.concatenate([room(0.5, 70), clips[1], room(1.0, 71)])
    results = []
    for chunk in (320, 77, 4801):
        s = Stream()
        s.feed(signal, chunk=chunk)
        (u,) = s.got
        results.append(u.audio)
    assert all(np.array_equal(results[0], r) for r in results[1:])


class Hints(Stream):
    """A Stream that also keeps the hints, with partials on."""

    def __init__(self) -> None:
        super().__init__(SegmenterConfig(partial_interval_ms=1000))
        self.hints: list[SegmentedSpeech] = []

    def speech_so_far(self, u: SegmentedSpeech) -> None:
        self.hints.append(u)


def cuts(s: Hints) -> list[tuple]:
    return [(u.kind, u.first_sample, u.revision, u.cut, u.audio.tobytes()) for u in s.got + s.hints]


def test_digital_silence_cuts_alike_in_any_chunking(clips: list[np.ndarray]) -> None:
    """Silence sent as zeros (the WebSocket clients' own) takes a shortcut while no utterance is
    open: the utterances and hints are the same whatever the chunking, and the same when the
    caller writes its next audio into the buffer it just fed (a decoder's reused buffer)."""
    zeros = lambda s: np.zeros(int(s * RATE), np.float32)  # noqa: E731
    signal = np.concatenate([zeros(0.7), clips[1], zeros(0.9), clips[4], zeros(0.3), room(0.4, 72), zeros(1.2)])
    results = []
    for chunk in (960, 320, 77, 4801):
        s = Hints()
        s.feed(signal, chunk=chunk)
        results.append(cuts(s))
    reused = Hints()
    pcm, buffer = q16(signal), np.zeros(960, np.int16)
    for i in range(0, len(pcm) // 960 * 960, 960):
        buffer[:] = pcm[i : i + 960]
        reused.fed += 960
        reused.seg.feed(buffer)
    results.append(cuts(reused))
    assert len([r for r in results[0] if r[0] == "final"]) == 2 and any(r[0] == "partial" for r in results[0])
    assert all(r == results[0] for r in results[1:])


def av_frames(mono_16k: np.ndarray, rate: int, layout: str, samples: int) -> list[av.AudioFrame]:
    """The clip as a transport would deliver it: s16 packed frames of ``samples`` each,
    upsampled by av itself, with WebRTC-style pts that jump."""
    up = av.AudioResampler(format="s16", layout=layout, rate=rate)
    frame = av.AudioFrame.from_ndarray(q16(mono_16k)[None, :], format="s16", layout="mono")
    frame.sample_rate = RATE
    pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in up.resample(frame) + up.resample(None)])
    channels = 2 if layout == "stereo" else 1
    step = samples * channels
    out = []
    for n, i in enumerate(range(0, len(pcm) // step * step, step)):
        f = av.AudioFrame.from_ndarray(pcm[None, i : i + step], format="s16", layout=layout)
        f.sample_rate = rate
        f.pts = n * samples + (5000 if n > 50 else 0)  # a jump, as after packet loss
        out.append(f)
    return out


def correlation(x: np.ndarray, y: np.ndarray) -> float:
    n = min(len(x), len(y))
    return float(np.corrcoef(x[:n].astype(np.float64), y[:n].astype(np.float64))[0, 1])


def test_to16k_mono_from_48k_stereo(clips: list[np.ndarray]) -> None:
    clip = clips[0]
    conv = To16kMono()
    out = np.concatenate([conv.push(f) for f in av_frames(clip, 48000, "stereo", 960)] + [conv.flush()])
    assert out.dtype == np.int16 and out.ndim == 1
    assert abs(len(out) - len(clip)) <= 0.01 * len(clip)
    assert correlation(out, q16(clip)) > 0.9


def test_to16k_mono_format_change_mid_stream(clips: list[np.ndarray]) -> None:
    a, b = clips[1], clips[2]
    conv = To16kMono()
    parts = [conv.push(f) for f in av_frames(a, 48000, "stereo", 960)]
    parts += [conv.push(f) for f in av_frames(b, 44100, "mono", 882)]  # renegotiated mid-call
    out = np.concatenate(parts + [conv.flush()])
    assert abs(len(out) - len(a) - len(b)) <= 0.01 * (len(a) + len(b))
    assert correlation(out[len(out) - len(b) :], q16(b)) > 0.9


def test_push_pcm16_passes_16k_mono_through(clips: list[np.ndarray]) -> None:
    conv = To16kMono()
    pcm = q16(clips[0][:RATE])
    assert np.array_equal(conv.push_pcm16(pcm), pcm)
    assert np.array_equal(conv.push_pcm16(clips[0][:RATE]), pcm)
    with pytest.raises(ValueError):
        conv.push_pcm16(np.zeros((2, 10), dtype=np.int16))
