"""The CPU default: the project's ONNX graphs on ONNX Runtime."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnxruntime as ort

from engines.graphs import graph_paths
from engines.weights import Weights


@dataclass
class DecoderState:
    self_k: np.ndarray  # [layers, batch, heads, past, head_dim]
    self_v: np.ndarray
    cross_k: np.ndarray  # [layers, batch, heads, head_dim, ctx]
    cross_v: np.ndarray  # [layers, batch, heads, ctx, head_dim]


class OnnxRuntimeBackend:
    name = "onnxruntime"

    def __init__(self, weights: Weights, threads: int, progress: Callable[[str], None] | None = None) -> None:
        encoder_path, decoder_path = graph_paths(weights, progress)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        providers = ["CPUExecutionProvider"]
        self.encoder = ort.InferenceSession(str(encoder_path), options, providers=providers)
        self.decoder = ort.InferenceSession(str(decoder_path), options, providers=providers)
        d = weights.dims
        self._cache_shape = (d.n_text_layer, d.n_heads, d.n_audio_state // d.n_heads)

    def encode(self, mel: np.ndarray) -> DecoderState:
        cross_k, cross_v = self.encoder.run(None, {"mel": np.ascontiguousarray(mel, dtype=np.float32)})
        layers, heads, head_dim = self._cache_shape
        empty = np.zeros((layers, mel.shape[0], heads, 0, head_dim), np.float32)
        return DecoderState(empty, empty, cross_k, cross_v)

    def step(self, tokens: np.ndarray, state: DecoderState) -> tuple[np.ndarray, DecoderState]:
        feeds = {
            "tokens": np.ascontiguousarray(tokens, dtype=np.int64),
            "self_k": state.self_k,
            "self_v": state.self_v,
            "cross_k": state.cross_k,
            "cross_v": state.cross_v,
        }
        logits, self_k, self_v = self.decoder.run(None, feeds)
        return logits, DecoderState(self_k, self_v, state.cross_k, state.cross_v)

    def keep(self, state: DecoderState, rows: np.ndarray) -> DecoderState:
        return DecoderState(*(np.ascontiguousarray(a[:, rows]) for a in (state.self_k, state.self_v, state.cross_k, state.cross_v)))
