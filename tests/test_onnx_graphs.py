"""The ONNX graphs against the plain-numpy reference forward pass (tests/reference_whisper.py)."""

import numpy as np
import pytest

from engines.backends.onnxruntime import OnnxRuntimeBackend, new_session
from engines.features import log_mel
from engines.graphs import build_decoder, build_encoder, FLAVOURS
from engines.weights import load_weights
from tests import reference_whisper as ref

PREFIXES = {"tiny.en": [50257, 50362], "base": [50258, 50259, 50359, 50363]}


def _session_logits(model: str, flavour: str, mel: np.ndarray, tokens: list[int], n_prefix: int) -> np.ndarray:
    """Logits of every position from the prefix on: the prefix in one chunk, then token by token
    through the cache, as decoding runs."""
    if flavour == "portable":
        backend = _portable_backend(model)
    else:
        backend = OnnxRuntimeBackend(load_weights(model), threads=2, precision=flavour)
    state = backend.encode(mel)
    logits, state = backend.step(np.array([tokens[:n_prefix]]), state)
    got = [logits[0]]
    for t in tokens[n_prefix:]:
        logits, state = backend.step(np.array([[t]]), state)
        got.append(logits[0])
    return np.stack(got)


def _portable_backend(model: str) -> OnnxRuntimeBackend:
    """The standard-ONNX graphs (what TensorRT builds from), run by ONNX Runtime."""
    w = load_weights(model)
    backend = OnnxRuntimeBackend(w, threads=2, precision="fp32")
    backend.encoder = new_session(build_encoder(w, FLAVOURS["portable"]).SerializeToString(), threads=2)
    backend.decoder = new_session(build_decoder(w, FLAVOURS["portable"]).SerializeToString(), threads=2)
    return backend


@pytest.mark.parametrize("model", ["tiny.en", "base"])
def test_graphs_match_the_reference_forward_pass(model, librivox):
    w = load_weights(model)
    tensors = ref.as_float64(w.tensors)
    mel = log_mel(librivox[0][1], 1000)[None]  # shorter than 30 s: exercises the dynamic frame axis
    prefix = PREFIXES[model]
    tokens = prefix + [440, 1332, 11]
    features = ref.encode(tensors, w.dims, mel.astype(np.float64))
    want = ref.decoder_logits(tensors, w.dims, np.array([tokens]), features)[0][len(prefix) - 1 :]
    scale = np.abs(want).max()
    for flavour in ("portable", "fp32"):  # the same math: float rounding only
        got = _session_logits(model, flavour, mel, tokens, len(prefix))
        assert np.abs(got - want).max() / scale < 1e-4, flavour
        assert (got.argmax(-1) == want.argmax(-1)).all(), flavour
    # int8 weights: close, and the same next token wherever the reference is not near a tie
    # (these forced tokens are not what the model would say, so some positions are).
    got = _session_logits(model, "int8", mel, tokens, len(prefix))
    assert np.abs(got - want).max() / scale < 0.1
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1.0
    assert clear.any()
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


def test_batched_encoder_rows_equal_single_rows(librivox):
    backend = OnnxRuntimeBackend(load_weights("tiny.en"), threads=2, precision="fp32")
    mels = np.stack([log_mel(a[: 16000 * 4], 800) for _, a, _ in librivox[:3]])
    batched = backend.encode(mels)
    for i in range(3):
        single = backend.encode(mels[i : i + 1])
        for name, array in single.cross_kv.items():
            np.testing.assert_allclose(batched.cross_kv[name][i], array[0], rtol=1e-4, atol=1e-4)
