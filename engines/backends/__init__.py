"""Inference backends: each runs the encoder and one decoder step for a batch.

The decoding rules (engines/decoding.py) are written once against this interface, so a new
backend only has to move tensors, not re-implement Whisper.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from engines.weights import Weights


class Backend(Protocol):
    name: str

    def encode(self, mel: np.ndarray) -> Any:
        """mel [batch, 80, frames] -> an opaque decoder state holding the cross-attention K/V."""

    def step(self, tokens: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        """tokens [batch, n] -> logits of the next token [batch, vocab] (float32) and the new state."""

    def keep(self, state: Any, rows: np.ndarray) -> Any:
        """The state of the listed batch rows only: finished utterances stop costing work."""


BACKENDS = ("onnxruntime",)


def create_backend(
    name: str, weights: Weights, threads: int, precision: str, progress: Callable[[str], None] | None = None
) -> Backend:
    if name in ("onnxruntime", "auto"):
        from engines.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(weights, threads, precision, progress)
    raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}, auto")
