"""The default classifier: sentence embedding + text cues -> softmax over the five labels.

Trained by `python -m benchmarks.intent.train` (weights in intent_model.npz beside this file):
multinomial logistic regression on the train split, its temperature fitted on the dev split
so that `score` is a calibrated probability, and the confidence threshold below which the
label is None chosen on the dev split. The test split is never looked at in training.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import numpy as np

from streamserver.intent import LABELS, Intent
from streamserver.intent.cues import cue_vector
from streamserver.intent.e5_onnx import OnnxE5Embedder
from streamserver.intent.ngrams import ngram_vector

MODEL_PATH = Path(__file__).with_name("intent_model.npz")
EMBEDDING_DIM = 384  # multilingual-e5-small's
MAX_CHARS = 512  # a transcript longer than this is classified on its start (e5 reads 512 tokens)


class Embedder(Protocol):
    """texts -> float32 [n, 384] L2-normalised multilingual-e5-small query embeddings."""

    def embed(self, texts: list[str]) -> np.ndarray: ...


def intent_embedder_for(speech_backend: str) -> Embedder:
    """The sentence embedder beside a speech engine: on its GPU when it has one (torch-cuda: the
    labels then cost the host's CPU almost nothing, where the CPU embedder takes several cores
    of a busy GPU host), else ONNX Runtime on the CPU. STREAMSERVER_INTENT_DEVICE=cpu keeps them
    on the CPU (auto, the default: as above)."""
    choice = os.environ.get("STREAMSERVER_INTENT_DEVICE", "auto")
    if choice not in ("auto", "cpu"):
        raise ValueError(f"STREAMSERVER_INTENT_DEVICE={choice!r}: expected auto or cpu")
    if speech_backend == "torch-cuda" and choice == "auto":
        from streamserver.intent.e5_torch import TorchE5Embedder

        return TorchE5Embedder("cuda")
    return OnnxE5Embedder()


# Weight of the n-gram bag against the standardised embedding and cues (chosen on the dev split:
# dev accuracy 0.79 without n-grams, 0.83 with them at 30).
NGRAM_SCALE = 30.0


def features(embedder: Embedder, texts: list[str]) -> np.ndarray:
    """Sentence embedding + text cues (standardised later) and the n-gram bag (already scaled)."""
    clipped = [t.strip()[:MAX_CHARS] for t in texts]
    embedded = embedder.embed([t if t else "." for t in clipped])
    cues = np.stack([cue_vector(t) for t in clipped])
    grams = np.stack([ngram_vector(t) for t in clipped])
    return np.hstack([embedded, cues]), grams


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class EmbeddingIntentClassifier:
    def __init__(self, path: Path = MODEL_PATH, embedder: Embedder | None = None) -> None:
        data = np.load(path)
        self.weights, self.bias = data["weights"], data["bias"]
        self.mean, self.std = data["mean"], data["std"]
        self.temperature = float(data["temperature"])
        self.threshold = float(data["threshold"])
        self.embedder = embedder or OnnxE5Embedder()

    def probabilities(self, texts: list[str]) -> np.ndarray:
        return self._probabilities(texts)[0]

    def _probabilities(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The labels' probabilities and the texts' sentence embeddings they were read from."""
        dense, grams = features(self.embedder, texts)
        x = np.hstack([(dense - self.mean) / self.std, NGRAM_SCALE * grams])
        logits = x @ self.weights + self.bias
        return softmax(logits / self.temperature), dense[:, :EMBEDDING_DIM]

    def classify(self, texts: list[str]) -> list[Intent]:
        """A label (or None when unsure) per text; empty or symbol-only text is None, never an error."""
        return self.classify_embedded(texts)[0]

    def classify_embedded(self, texts: list[str]) -> tuple[list[Intent], np.ndarray]:
        """classify(), and each text's L2-normalised e5 embedding [n, 384] that the labels read
        (question groups file questions by it: intent/groups.py): one embedding for both."""
        if not texts:
            return [], np.zeros((0, EMBEDDING_DIM), np.float32)
        out: list[Intent] = []
        probs, embedded = self._probabilities(texts)
        for text, p in zip(texts, probs):
            best = int(p.argmax())
            has_words = any(ch.isalnum() for ch in text)
            confident = has_words and p[best] >= self.threshold
            out.append(Intent(LABELS[best] if confident else None, float(p[best])))
        return out, embedded
