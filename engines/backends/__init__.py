"""Inference backends: each runs the encoder and one decoder step for a batch.

The decoding rules (engines/decoding.py) are written once against this interface, so a new
backend only has to move tensors, not re-implement Whisper.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from engines.weights import Weights


class BackendUnavailable(RuntimeError):
    """A backend cannot run here: its package or its hardware is missing (the message says which)."""


class Backend(Protocol):
    name: str

    def encode(self, mel: np.ndarray) -> Any:
        """mel [batch, 80, frames] -> an opaque decoder state holding the cross-attention K/V."""

    def step(self, tokens: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        """tokens [batch, n] -> logits of the next token [batch, vocab] (float32) and the new state."""

    def keep(self, state: Any, rows: np.ndarray) -> Any:
        """The state of the listed batch rows only: finished utterances stop costing work."""


# Step-by-step backends. "torch-cuda" is a whole engine (engines/backends/torch_cuda.py) and
# "auto" a choice among them: engines.engine.load_engine resolves both.
BACKENDS = ("onnxruntime", "tensorrt")
ENGINES = ("tensorrt", "torch-cuda", "onnxruntime")  # what "auto" tries, in this order


def create_backend(
    name: str, weights: Weights, threads: int, precision: str, progress: Callable[[str], None] | None = None
) -> Backend:
    if name == "onnxruntime":
        from engines.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(weights, threads, precision, progress)
    if name == "tensorrt":
        try:
            from engines.tensorrt.runtime import TensorRTBackend
        except ImportError as error:
            raise BackendUnavailable(f"the tensorrt backend cannot load here: {error}") from error
        # int8 is the CPU default; int8 TensorRT engines need calibration audio, so they are built
        # on purpose (`streamserver engine build --precision int8`), and the default here is fp16.
        return TensorRTBackend(weights, threads, "fp16" if precision == "int8" else precision, progress)
    raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(ENGINES)}, auto")
