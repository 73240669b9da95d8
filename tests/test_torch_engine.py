"""The PyTorch engine (the GPU path) against the ONNX Runtime engine, on the CPU where torch is
installed: the same weights in float32 must give the same tokens. On a CUDA machine the same
checks run in fp16 by benchmarks/gpu_bench.py (transcripts compared with the CPU's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install 'streamserver[gpu]')")

from engines.audio import load_audio  # noqa: E402
from engines.features import as_float, log_mel  # noqa: E402
from engines.gpu.engine import TorchCudaEngine  # noqa: E402
from engines.gpu.inflight import InflightDecoder  # noqa: E402
from engines.gpu.model import GpuLogMel  # noqa: E402
from engines.loading import load_engine  # noqa: E402

DATA = Path(__file__).parent / "data"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    return [load_audio(p) for p in sorted(DATA.glob("*/*.wav"))]


def _torch_engine(model: str, slots: int = 16) -> TorchCudaEngine:
    return TorchCudaEngine.of_model(model, device=CPU, slots=slots)


def test_log_mel_matches_numpy(clips):
    mel = GpuLogMel(CPU)
    for audio in clips:
        for fill in (None, 0.0):
            ref = log_mel(audio, 3000, fill)
            np.testing.assert_allclose(mel([audio], 3000, fill)[0].numpy(), ref, atol=1e-4)


def test_batched_log_mel_of_clips_of_every_length_matches_numpy(clips):
    """Filled windows compute the STFT only as far as the batch's longest clip: each row must
    still be what it is alone, at a 30 s window and at a shorter one, and with a near-full clip."""
    mel = GpuLogMel(CPU)
    long = np.concatenate([clips[0]] * (29 * 16000 // clips[0].size + 1))[: 29 * 16000 + 123]
    for batch in (clips, clips + [long]):
        for frames in (3000, 1000):
            fitting = [a for a in batch if a.size < frames * 160]
            got = mel(fitting, frames, 0.0).numpy()
            for row, audio in zip(got, fitting):
                np.testing.assert_allclose(row, log_mel(audio, frames, 0.0), atol=1e-4)


def test_pcm16_batches_give_the_log_mel_of_their_float32(clips):
    """Queued utterances (int16 PCM) are uploaded as they are and scaled on the device."""
    mel = GpuLogMel(CPU)
    pcm = [np.round(a * 32767).astype(np.int16) for a in clips]
    for frames, fill in ((3000, 0.0), (3000, None), (1000, 0.0)):
        fitting = [p for p in pcm if p.size < frames * 160]
        np.testing.assert_array_equal(mel(fitting, frames, fill).numpy(), mel([as_float(p) for p in fitting], frames, fill).numpy())


def test_pcm16_batches_with_a_buckets_empty_fill_stay_pcm16(clips, monkeypatch):
    """The engine fills a batch up to its bucket with empty float32 clips: they have no samples,
    and the batch's PCM16 still goes up as PCM16 (one staging dtype, not a switch per batch)."""
    mel = GpuLogMel(CPU)
    pcm = [np.round(a * 32767).astype(np.int16) for a in clips[:3]]
    filled = pcm + [np.zeros(0, np.float32)]
    uploads: list[torch.dtype] = []
    upload = mel._upload
    monkeypatch.setattr(mel, "_upload", lambda audios, dtype: uploads.append(dtype) or upload(audios, dtype))
    got = mel(filled, 3000, 0.0).numpy()
    assert uploads == [torch.int16]
    np.testing.assert_array_equal(got[:3], mel(pcm, 3000, 0.0).numpy())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned staging buffer is the CUDA path's")
def test_staging_buffer_grows_only_for_more_bytes():
    """Batches of PCM16 and of float32 in turn reuse the two pinned buffers: a buffer allocated
    again at every change of dtype, twice as large each time, kept doubling."""
    mel = GpuLogMel(torch.device("cuda"))
    rng = np.random.default_rng(0)
    pcm = [rng.integers(-3000, 3000, 16000 * 5, dtype=np.int16) for _ in range(8)]
    floats = [as_float(p) for p in pcm]
    sizes = []
    for _ in range(10):
        for batch in (pcm, floats, pcm[:2] + [np.zeros(0, np.float32)]):
            mel(batch, 3000, 0.0)
            sizes.append(sorted(b.numel() for b, _ in mel._staging))
    # Two buffers in turn: after two rounds each has held the largest batch, and grows no more.
    assert all(s == sizes[5] for s in sizes[5:]), sizes
    assert max(sizes[-1]) <= 2 * 8 * 16000 * 5 * 4


def test_transcripts_equal_onnxruntime_fp32(clips):
    torch.set_num_threads(2)
    ours = _torch_engine("tiny.en").transcribe_batch(clips, "en")
    ref = load_engine("tiny.en", precision="fp32").transcribe_batch(clips, "en")
    assert [t.text for t in ours] == [t.text for t in ref]
    assert all(t.text for t in ours)
    for a, b in zip(ours, ref):
        assert abs(a.avg_logprob - b.avg_logprob) < 1e-3 and abs(a.no_speech_prob - b.no_speech_prob) < 1e-3


def test_slots_refill_and_batch_equals_one_at_a_time(clips):
    """With 2 slots for 4+ utterances, finished slots are refilled mid-decode (in-flight batching)."""
    torch.set_num_threads(2)
    engine = _torch_engine("tiny.en", slots=2)
    batched = engine.transcribe_batch(clips * 2, "en")
    alone = [engine.transcribe_batch([c], "en")[0] for c in clips]
    assert [t.text for t in batched] == [t.text for t in alone] * 2
    assert engine.decoder.active == 0 and not engine.decoder.pending


def test_slots_of_different_windows_decode_as_each_alone(clips):
    """At a window by length (bucket5s), one step holds slots of different encoder lengths: the
    shorter ones read their own positions through the cross-attention's mask, a slot alone at the
    step's whole context reads it unmasked; both give the tokens each gives alone."""
    torch.set_num_threads(2)
    engine = TorchCudaEngine.of_model("tiny.en", "bucket5s-zero", device=CPU, slots=16)
    assert len({engine.policy.frames(c.size) for c in clips}) > 1
    batched = engine.transcribe_batch(clips, "en")
    alone = [engine.transcribe_batch([c], "en")[0] for c in clips]
    assert [t.text for t in batched] == [t.text for t in alone]
    assert all(t.text for t in batched)
    for a, b in zip(batched, alone):
        assert abs(a.avg_logprob - b.avg_logprob) < 1e-4


def test_non_speech_gives_no_words():
    engine = _torch_engine("tiny.en")
    noise = np.random.default_rng(0).normal(0, 0.05, 16000 * 3).astype(np.float32)
    assert [t.text for t in engine.transcribe_batch([np.zeros(16000, np.float32), noise], "en")] == ["", ""]


def test_bad_sizes_are_refused():
    engine = _torch_engine("tiny.en")
    with pytest.raises(ValueError):
        InflightDecoder(engine.whisper, engine.tokenizer, slots=3)  # not a batch bucket


def test_prompted_prefixes_of_two_languages_share_a_batch(clips):
    """base: a Mandarin prefix (with its default prompt) and an English one are prefilled as two
    groups of one admitted batch; each gives the tokens it gives alone and the CPU fp32 text."""
    torch.set_num_threads(2)
    engine = _torch_engine("base")
    ref = load_engine("base", precision="fp32")
    audios, languages = clips[:2], ["zh", "en"]
    alone = [engine.transcribe_batch([a], lang)[0] for a, lang in zip(audios, languages)]
    expected = [ref.transcribe_batch([a], lang)[0] for a, lang in zip(audios, languages)]
    assert [t.text for t in alone] == [t.text for t in expected]
    for a, b in zip(alone, expected):
        assert abs(a.no_speech_prob - b.no_speech_prob) < 1e-3
    frames = engine.policy.frames(max(a.size for a in audios))
    jobs = engine.jobs(audios, languages, None)
    assert len({len(j.prefix) for j in jobs}) == 2  # the prompt makes the Mandarin prefix longer
    cross_kv, ready, prefilled = engine.encode(audios, frames)  # no shared prefix: prefilled at admission
    assert prefilled is None
    engine.decoder.run(cross_kv, jobs, ready)
    texts = [engine._finish(j.result, frames).text for j in jobs]
    assert texts == [t.text for t in alone]
