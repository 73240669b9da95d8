"""Train the intent classifier on benchmarks/intent/utterances.jsonl (train split), calibrate on
the dev split, write streamserver/intent/intent_model.npz. The test split is not read.

A development tool beside its data, not part of the package: the installed server only reads
the intent_model.npz this writes (package data).

    .venv/bin/python -m benchmarks.intent.train
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from streamserver.intent import LABELS
from streamserver.intent.e5_onnx import OnnxE5Embedder
from streamserver.intent.model import MODEL_PATH, NGRAM_SCALE, features, softmax

DATA = Path(__file__).resolve().with_name("utterances.jsonl")
EXTRA = DATA.with_name("train_extra.jsonl")  # more training lines, written apart from the test split


def load(split: str, path: Path = DATA) -> tuple[list[str], np.ndarray]:
    files = [path] + ([EXTRA] if split == "train" and EXTRA.exists() else [])
    rows = [json.loads(line) for f in files for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [r for r in rows if r["split"] == split]
    return [r["text"] for r in rows], np.array([LABELS.index(r["label"]) for r in rows])


def fit_softmax(x: np.ndarray, y: np.ndarray, l2: float = 1e-2, steps: int = 2000, lr: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Multinomial logistic regression by full-batch gradient descent (a few hundred rows)."""
    n, d = x.shape
    w, b = np.zeros((d, len(LABELS))), np.zeros(len(LABELS))
    onehot = np.eye(len(LABELS))[y]
    for _ in range(steps):
        p = softmax(x @ w + b)
        grad = (p - onehot) / n
        w -= lr * (x.T @ grad + l2 * w)
        b -= lr * grad.sum(axis=0)
    return w, b


def fit_temperature(logits: np.ndarray, y: np.ndarray) -> float:
    """The temperature that minimises the dev set's negative log-likelihood."""
    grid = np.exp(np.linspace(np.log(0.2), np.log(5.0), 60))
    nll = [-np.log(softmax(logits / t)[np.arange(len(y)), y] + 1e-12).mean() for t in grid]
    return float(grid[int(np.argmin(nll))])


def pick_threshold(probs: np.ndarray, y: np.ndarray, max_cost: float = 0.01) -> float:
    """The highest confidence threshold (up to 0.5) whose nulls cost at most max_cost of dev
    accuracy: null is kept for the genuinely unsure, not used to hide hard cases."""
    best, right = probs.max(axis=1), probs.argmax(axis=1) == y
    chosen = 0.0
    for t in np.linspace(0.2, 0.5, 31):
        if (right & (best >= t)).mean() >= right.mean() - max_cost:
            chosen = float(t)
    return chosen


def main() -> None:
    embedder = OnnxE5Embedder()
    train_texts, train_y = load("train")
    dev_texts, dev_y = load("dev")
    dense, grams = features(embedder, train_texts)
    # Standardised, so that the embedding's small coordinates and the 0/1 cues train alike.
    mean, std = dense.mean(axis=0), dense.std(axis=0) + 1e-6
    w, b = fit_softmax(np.hstack([(dense - mean) / std, NGRAM_SCALE * grams]), train_y)
    dev_dense, dev_grams = features(embedder, dev_texts)
    dev_logits = np.hstack([(dev_dense - mean) / std, NGRAM_SCALE * dev_grams]) @ w + b
    temperature = fit_temperature(dev_logits, dev_y)
    probs = softmax(dev_logits / temperature)
    threshold = pick_threshold(probs, dev_y)
    np.savez(
        MODEL_PATH, weights=w.astype(np.float32), bias=b.astype(np.float32), mean=mean.astype(np.float32),
        std=std.astype(np.float32), temperature=temperature, threshold=threshold,
    )
    accuracy = float((probs.argmax(axis=1) == dev_y).mean())
    print(f"train {len(train_y)}, dev {len(dev_y)}: dev accuracy {accuracy:.3f}, temperature {temperature:.2f}, "
          f"threshold {threshold:.2f} -> {MODEL_PATH}", file=sys.stderr)


if __name__ == "__main__":
    main()
