"""The CPU default: the project's ONNX graphs on ONNX Runtime."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as C

from engines.graphs import graph_paths
from engines.weights import Weights


_shared_pool_threads: int | None = None


def _use_shared_thread_pool(threads: int) -> None:
    """ONNX Runtime's process-wide pool is sized once, before the first session that uses it."""
    global _shared_pool_threads
    if _shared_pool_threads is None:
        C.set_global_thread_pool_sizes(threads, 1)
        _shared_pool_threads = threads
    elif _shared_pool_threads != threads:
        raise ValueError(f"this process already runs ONNX Runtime with {_shared_pool_threads} threads, not {threads}")


def pool_threads() -> int | None:
    """The size of the process-wide pool, or None before the first session sized it."""
    return _shared_pool_threads


def new_session(model: str | bytes, threads: int) -> ort.InferenceSession:
    """A CPU session on the process-wide thread pool.

    One pool for every session: with a pool each, the pool that just ran keeps spinning and
    steals the cores from the other (figures in benchmarks/README.md).
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if os.environ.get("STREAMSERVER_ORT_SPIN", "1") == "0":
        # Several engine processes on few cores (scale-out workers): threads that spin while
        # waiting for work take the cores from the other processes. The process-wide pool
        # cannot be told not to spin, so each session gets its own pool that sleeps instead.
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    _use_shared_thread_pool(threads)
    options.use_per_session_threads = False
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


@dataclass
class DecoderState:
    """Per-layer caches, as the graphs take them: name -> [batch, heads, positions, head_dim]
    for self- and cross-attention alike)."""

    self_kv: dict[str, np.ndarray]  # self_k_i / self_v_i
    cross_kv: dict[str, np.ndarray]  # cross_k_i / cross_v_i


class OnnxRuntimeBackend:
    name = "onnxruntime"

    def __init__(
        self, weights: Weights, threads: int, precision: str = "fp32", progress: Callable[[str], None] | None = None
    ) -> None:
        encoder_path, decoder_path = graph_paths(weights, precision, progress)
        self.encoder = new_session(str(encoder_path), threads)
        self.decoder = new_session(str(decoder_path), threads)
        d = weights.dims
        self._layers = d.n_text_layer
        self._empty_shape = (d.n_heads, 0, d.n_audio_state // d.n_heads)
        self._cross_names = [o.name for o in self.encoder.get_outputs()]
        # The int8 encoder scales activations per tensor: one utterance per call keeps each
        # result independent of the rest of the batch (on a CPU a batched encoder call is not
        # faster anyway: it is bound by arithmetic, not by per-call overhead; benchmarks/README.md,
        # "Batching on the CPU").
        self._encode_rows_apart = precision == "int8"
        self._new_self_names = [o.name for o in self.decoder.get_outputs()][1:]

    def encode(self, mel: np.ndarray) -> DecoderState:
        mel = np.ascontiguousarray(mel, dtype=np.float32)
        if self._encode_rows_apart and mel.shape[0] > 1:
            rows = [self.encoder.run(None, {"mel": mel[i : i + 1]}) for i in range(mel.shape[0])]
            outputs = [np.concatenate(parts) for parts in zip(*rows)]
        else:
            outputs = self.encoder.run(None, {"mel": mel})
        empty = np.zeros((mel.shape[0], *self._empty_shape), np.float32)
        self_kv = {f"self_{kv}_{i}": empty for i in range(self._layers) for kv in "kv"}
        return DecoderState(self_kv, dict(zip(self._cross_names, outputs)))

    def step(self, tokens: np.ndarray, state: DecoderState) -> tuple[np.ndarray, DecoderState]:
        feeds = {"tokens": np.ascontiguousarray(tokens, dtype=np.int64), **state.self_kv, **state.cross_kv}
        logits, *new_self = self.decoder.run(None, feeds)
        self_kv = {name.removeprefix("new_"): array for name, array in zip(self._new_self_names, new_self)}
        return logits, DecoderState(self_kv, state.cross_kv)

    def keep(self, state: DecoderState, rows: np.ndarray) -> DecoderState:
        def take(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return {name: np.ascontiguousarray(a[rows]) for name, a in arrays.items()}

        return DecoderState(take(state.self_kv), take(state.cross_kv))
