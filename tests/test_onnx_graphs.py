"""The ONNX graphs against the plain-numpy reference forward pass (tests/reference_whisper.py)."""

import numpy as np
import pytest

from engines.backends.onnxruntime import OnnxRuntimeBackend
from engines.features import log_mel
from engines.weights import load_weights
from tests import reference_whisper as ref


@pytest.mark.parametrize("model,prefix", [("tiny.en", [50257, 50362]), ("base", [50258, 50259, 50359, 50363])])
def test_decoder_logits_match_reference(model, prefix, librivox):
    w = load_weights(model)
    tensors = ref.as_float64(w.tensors)
    audio = librivox[0][1]
    mel = log_mel(audio, 1000)[None]  # a shorter-than-30 s window exercises the dynamic frame axis
    backend = OnnxRuntimeBackend(w, threads=2)
    state = backend.encode(mel)
    features = ref.encode(tensors, w.dims, mel.astype(np.float64))
    # The prefix plus three text tokens, fed as one chunk and then token by token through the cache.
    tokens = prefix + [440, 1332, 11]
    expected = ref.decoder_logits(tensors, w.dims, np.array([tokens]), features)[0]
    logits, state_after = backend.step(np.array([prefix]), state)
    got = [logits[0]]
    for t in tokens[len(prefix) :]:
        logits, state_after = backend.step(np.array([[t]]), state_after)
        got.append(logits[0])
    want = expected[len(prefix) - 1 :]
    scale = np.abs(want).max()
    assert np.abs(np.stack(got) - want).max() / scale < 1e-4
    assert [int(g.argmax()) for g in got] == [int(r.argmax()) for r in want]


def test_batched_encoder_rows_equal_single_rows(librivox):
    backend = OnnxRuntimeBackend(load_weights("tiny.en"), threads=2)
    mels = np.stack([log_mel(a[: 16000 * 4], 800) for _, a, _ in librivox[:3]])
    batched = backend.encode(mels)
    for i in range(3):
        single = backend.encode(mels[i : i + 1])
        for name, array in single.cross_kv.items():
            np.testing.assert_allclose(batched.cross_kv[name][i], array[0], rtol=1e-4, atol=1e-4)
