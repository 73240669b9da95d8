"""engines.audio.load_audio: real files in, 16 kHz mono float32 out, AudioError otherwise."""

import wave
from pathlib import Path

import av
import numpy as np
import pytest

from engines.audio import AudioError, load_audio

CLIP = Path(__file__).parent / "data" / "librivox" / "librivox_0870.wav"


def read_wav(path: Path) -> np.ndarray:
    with wave.open(str(path), "rb") as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return pcm.astype(np.float32) / 32768.0


def to_48k(mono_16k: np.ndarray) -> np.ndarray:
    resampler = av.AudioResampler(format="flt", layout="mono", rate=48000)
    frame = av.AudioFrame.from_ndarray(mono_16k[None, :], format="flt", layout="mono")
    frame.sample_rate = 16000
    out = resampler.resample(frame) + resampler.resample(None)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in out])


def encode_stereo(path: Path, container: str, codec: str, left: np.ndarray, right: np.ndarray, rate: int = 48000) -> None:
    """Write a stereo file with PyAV (explicit channels, no upmix matrix)."""
    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="stereo")
        ctx = stream.codec_context
        frame = av.AudioFrame.from_ndarray(np.stack([left, right]).astype(np.float32), format="fltp", layout="stereo")
        frame.sample_rate = rate
        fit = av.AudioResampler(format=ctx.codec.audio_formats[0].name, layout="stereo", rate=rate, frame_size=ctx.frame_size or None)
        for chunk in fit.resample(frame) + fit.resample(None):
            for packet in stream.encode(chunk):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    return read_wav(CLIP)


def test_wav_is_read_exactly(clip):
    audio = load_audio(CLIP)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert len(audio) == 113600  # 7.1 s at 16 kHz
    np.testing.assert_array_equal(audio, clip)
    assert np.array_equal(load_audio(str(CLIP)), audio)  # str works too


@pytest.mark.parametrize("name,container,codec", [("clip.mp3", "mp3", "libmp3lame"), ("clip.ogg", "ogg", "libopus")])
def test_lossy_48k_stereo_is_resampled_and_downmixed(tmp_path, clip, name, container, codec):
    x48 = to_48k(clip)
    path = tmp_path / name
    encode_stereo(path, container, codec, x48, x48)
    audio = load_audio(path)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) / 16000 - len(clip) / 16000) <= 0.01 * len(clip) / 16000
    n = min(len(audio), len(clip))
    assert np.corrcoef(audio[:n], clip[:n])[0, 1] > 0.95  # aligned, same signal
    rms_ratio = np.sqrt(np.mean(audio**2)) / np.sqrt(np.mean(clip**2))
    assert 0.8 < rms_ratio < 1.2  # downmix averages, no 3 dB gain or loss


def test_stereo_downmix_averages_and_stays_in_range(tmp_path):
    rate = 48000
    t = np.arange(rate) / rate
    loud = 0.9 * np.sin(2 * np.pi * 440 * t)
    path = tmp_path / "loud.flac"
    encode_stereo(path, "flac", "flac", loud, loud)
    audio = load_audio(path)
    assert len(audio) == 16000
    assert 0.88 < np.abs(audio).max() <= 0.91  # identical channels -> same level
    encode_stereo(path, "flac", "flac", loud, np.zeros_like(loud))
    assert 0.43 < np.abs(load_audio(path)).max() < 0.46  # one silent channel -> half


def test_rate_and_layout_change_midstream(tmp_path):
    # Two mp3s back to back (as some recorders append): 1 s 44.1 kHz stereo,
    # then 1 s 22.05 kHz mono. The resampler must be rebuilt, not crash.
    parts = []
    for rate, channels in ((44100, 2), (22050, 1)):
        tone = 0.3 * np.sin(2 * np.pi * 300 * np.arange(rate) / rate)
        part = tmp_path / f"part{rate}.mp3"
        if channels == 2:
            encode_stereo(part, "mp3", "libmp3lame", tone, tone, rate=rate)
        else:
            with av.open(str(part), "w", format="mp3") as out:
                stream = out.add_stream("libmp3lame", rate=rate, layout="mono")
                frame = av.AudioFrame.from_ndarray(tone[None, :].astype(np.float32), format="fltp", layout="mono")
                frame.sample_rate = rate
                fit = av.AudioResampler(format="s16p", layout="mono", rate=rate, frame_size=stream.codec_context.frame_size)
                for chunk in fit.resample(frame) + fit.resample(None):
                    for packet in stream.encode(chunk):
                        out.mux(packet)
                for packet in stream.encode(None):
                    out.mux(packet)
        parts.append(part.read_bytes())
    path = tmp_path / "joined.mp3"
    path.write_bytes(b"".join(parts))
    audio = load_audio(path)
    assert 1.9 < len(audio) / 16000 < 2.2  # encoder padding of the 2nd part stays
    assert 0.25 < np.abs(audio[-4000:]).max() < 0.35  # the second part is there


def test_truncated_file_gives_what_decodes(tmp_path, clip):
    path = tmp_path / "cut.flac"
    x48 = to_48k(clip)
    encode_stereo(path, "flac", "flac", x48, x48)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    audio = load_audio(path)
    assert 0.3 * len(clip) < len(audio) < 0.7 * len(clip)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.wav"
    with pytest.raises(AudioError, match="nope.wav.*not found"):
        load_audio(path)


def test_directory(tmp_path):
    with pytest.raises(AudioError, match="not a regular file"):
        load_audio(tmp_path)


def test_text_file_named_wav(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("this is not audio\n" * 20)
    with pytest.raises(AudioError, match="notes.wav") as info:
        load_audio(path)
    assert isinstance(info.value, ValueError)


def test_empty_wav(tmp_path):
    path = tmp_path / "empty.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"")
    with pytest.raises(AudioError, match="empty.wav.*no samples"):
        load_audio(path)


def test_video_without_audio(tmp_path):
    path = tmp_path / "silent.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for _ in range(3):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    with pytest.raises(AudioError, match="silent.mp4.*no audio stream"):
        load_audio(path)
