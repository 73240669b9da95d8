"""Inference backends: each runs the encoder and one decoder step for a batch.

The decoding rules (engines/decoding.py) are written once against this interface, so a new
backend only has to move tensors, not re-implement Whisper.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


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


# Step-by-step backends. "torch-cuda" is a whole engine (engines/gpu/) and "auto" a choice among
# them: engines/loading.py resolves both, and builds each backend.
BACKENDS = ("onnxruntime", "tensorrt")
ENGINES = ("tensorrt", "torch-cuda", "onnxruntime")  # what "auto" tries, in this order
DEFAULT_BACKEND = "onnxruntime"  # the CPU: every install can run it
