"""Checks of the numpy reference Whisper (tests/reference_whisper.py) itself.

The quick tests pin down the building blocks and structural properties (shapes, batching,
causality). The slow ones validate the oracle end to end: its greedy transcript of a LibriVox
clip must equal CTranslate2's, token for token, on the same weights. Those need faster_whisper
(for the feature extractor and ctranslate2) and are skipped without it.
"""

from __future__ import annotations

import json
import math
import wave
from pathlib import Path

import numpy as np
import pytest

from engines.weights import WeightsError, load_weights
from tests import reference_whisper as ref

CLIP_NAME = "librivox_0870.wav"
CLIP_CANDIDATES = (
    Path(__file__).resolve().parent / "data" / "librivox" / CLIP_NAME,
    Path("/work/shared/data/en_dev") / CLIP_NAME,
)
N_FRAMES = 3000  # 30 s of 10 ms mel frames: the encoder's full input


def _weights(name: str):
    try:
        return load_weights(name)
    except WeightsError as e:
        pytest.skip(f"weights for {name} not installed: {e}")


@pytest.fixture(scope="module")
def tiny():
    w = _weights("tiny.en")
    return w, ref.as_float64(w.tensors)


def _special_ids(folder: Path) -> dict[str, int]:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in tokenizer["added_tokens"]}


# --- building blocks -------------------------------------------------------------------------


def test_gelu_is_the_erf_form():
    x = np.array([-3.0, -1.0, 0.0, 0.5, 1.0, 3.0])
    expected = [v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x]
    np.testing.assert_allclose(ref.gelu(x), expected, rtol=0, atol=1e-15)
    assert ref.gelu(np.array([1.0]))[0] == pytest.approx(0.8413447460685429, abs=1e-15)


@pytest.mark.parametrize("stride", [1, 2])
def test_conv1d_matches_a_direct_loop(stride):
    rng = np.random.default_rng(0)
    x, w, b = rng.normal(size=(2, 5, 8)), rng.normal(size=(4, 5, 3)), rng.normal(size=4)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1)))
    t_out = (8 - 1) // stride + 1
    expected = np.zeros((2, 4, t_out))
    for n in range(2):
        for o in range(4):
            for t in range(t_out):
                expected[n, o, t] = b[o] + np.sum(w[o] * xp[n, :, stride * t : stride * t + 3])
    np.testing.assert_allclose(ref.conv1d(x, w, b, stride), expected, atol=1e-12)


def test_attention_is_softmax_weighted_average_with_causal_mask():
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(1, 2, 4, 3)) for _ in range(3))
    out = ref.attention(q, k, v, causal_offset=0)
    for h in range(2):
        for i in range(4):
            s = k[0, h, : i + 1] @ q[0, h, i] / math.sqrt(3)
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(out[0, h, i], p @ v[0, h, : i + 1], atol=1e-12)


# --- structure on real weights (short inputs) ------------------------------------------------


def test_encode_shape_and_batch_independence(tiny):
    w, t = tiny
    rng = np.random.default_rng(2)
    mel = rng.normal(size=(2, w.dims.n_mels, 40)) * 0.5
    both = ref.encode(t, w.dims, mel)
    assert both.shape == (2, 20, w.dims.n_audio_state)
    assert np.isfinite(both).all()
    np.testing.assert_allclose(both[1:], ref.encode(t, w.dims, mel[1:]), atol=1e-10)


@pytest.mark.parametrize("frames", [7, 3002])
def test_encode_rejects_bad_frame_counts(tiny, frames):
    w, t = tiny
    with pytest.raises(ValueError):
        ref.encode(t, w.dims, np.zeros((1, w.dims.n_mels, frames)))


def test_decoder_is_causal_and_batched(tiny):
    w, t = tiny
    rng = np.random.default_rng(3)
    audio = ref.encode(t, w.dims, rng.normal(size=(2, w.dims.n_mels, 60)) * 0.5)
    tokens = np.array([[50257, 50362, 464, 3290, 13], [50257, 50362, 40, 716, 257]])
    logits = ref.decoder_logits(t, w.dims, tokens, audio)
    assert logits.shape == (2, 5, w.dims.n_vocab)
    # a position never sees later tokens
    np.testing.assert_allclose(logits[:, :3], ref.decoder_logits(t, w.dims, tokens[:, :3], audio), atol=1e-10)
    # nor the other utterances of the batch
    np.testing.assert_allclose(logits[1:], ref.decoder_logits(t, w.dims, tokens[1:], audio[1:]), atol=1e-10)


# --- end to end against CTranslate2 (the oracle's own validation) -----------------------------


def _clip_features() -> np.ndarray:
    fw = pytest.importorskip("faster_whisper.feature_extractor")
    clip = next((p for p in CLIP_CANDIDATES if p.exists()), None)
    if clip is None:
        pytest.skip(f"{CLIP_NAME} not found")
    with wave.open(str(clip), "rb") as f:
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (16000, 1, 2)
        audio = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    mel = fw.FeatureExtractor()(audio)[:, :N_FRAMES]
    return np.pad(mel, ((0, 0), (0, N_FRAMES - mel.shape[1]))).astype(np.float32)  # [80, 3000]


def _ctranslate2_greedy(folder: Path, mel: np.ndarray, prompt: list[int], max_length: int) -> list[int]:
    ctranslate2 = pytest.importorskip("ctranslate2")
    model = ctranslate2.models.Whisper(str(folder), device="cpu", compute_type="float32")
    features = ctranslate2.StorageView.from_array(np.ascontiguousarray(mel[None]))
    result = model.generate(features, [prompt], beam_size=1, suppress_blank=False, suppress_tokens=[],
                            max_length=max_length)
    return list(result[0].sequences_ids[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, prompt_names, eot_name",
    [
        ("tiny.en", ["<|startoftranscript|>", "<|notimestamps|>"], "<|endoftext|>"),
        ("base", ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"], "<|endoftext|>"),
    ],
)
def test_greedy_matches_ctranslate2(model, prompt_names, eot_name):
    mel = _clip_features()
    w = _weights(model)
    ids = _special_ids(w.folder)
    prompt, eot = [ids[n] for n in prompt_names], ids[eot_name]
    expected_prompt = {"tiny.en": [50257, 50362], "base": [50258, 50259, 50359, 50363]}[model]
    assert prompt == expected_prompt, f"{model} special-token ids moved: {prompt}"

    want = _ctranslate2_greedy(w.folder, mel, prompt, max_length=100)
    got = ref.greedy(w.tensors, w.dims, mel, prompt, eot=eot, max_tokens=100)
    assert len(want) >= 20, f"ctranslate2 produced only {want}"
    assert got == want  # the whole utterance, up to end-of-text, token for token
