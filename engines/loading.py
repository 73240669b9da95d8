"""Engine loading: a packaged model and a backend name in, an Engine out.

The one module that knows every engine: the step-by-step backends (engines/backends/onnxruntime.py,
engines/tensorrt/runtime.py) under a StepEngine, and the GPU engine (engines/gpu/). Each is
imported only when chosen, so the CPU install never needs torch, TensorRT or CUDA. Nothing in
engines/ imports this module.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

from engines.backends import DEFAULT_BACKEND, ENGINES, Backend, BackendUnavailable
from engines.engine import Engine, StepEngine
from engines.features import SAMPLE_RATE
from engines.graphs import DEFAULT_PRECISION
from engines.policy import POLICIES, EncoderPolicy, caption_policy, default_policy
from engines.tokenizer import WhisperTokenizer
from engines.weights import DEFAULT_MODEL, Weights, load_weights

log = logging.getLogger(__name__)

# Engine loads by (backend, outcome): what /metrics reports, and how a silent fall back to the CPU
# shows up on a machine whose GPU path broke.
ENGINE_LOADS: Counter[tuple[str, str]] = Counter()


def load_engine(
    model: str = DEFAULT_MODEL,
    backend: str = DEFAULT_BACKEND,
    threads: int = 2,
    policy: str | None = None,
    precision: str = DEFAULT_PRECISION,
    progress: Callable[[str], None] | None = None,
) -> Engine:
    """An engine for a packaged model; the first call builds its graphs into the cache.
    policy None takes the model's measured default (engines/policy.py). backend "auto" tries
    tensorrt, then torch-cuda, then onnxruntime, with a warning for each that cannot load."""
    if backend != "auto" and backend not in ENGINES:
        raise ValueError(f"unknown backend {backend!r}; choose one of: {', '.join(ENGINES)}, auto")
    weights = load_weights(model)
    policy = policy or default_policy(weights.twin or model)  # a folder of packaged weights: the measured one
    if policy not in POLICIES:
        raise ValueError(f"unknown encoder policy {policy!r}; choose one of: {', '.join(POLICIES)}")
    tokenizer = WhisperTokenizer.load(weights.folder, weights.config, weights.dims.n_vocab)
    for name in ENGINES if backend == "auto" else (backend,):
        try:
            engine = _engine(name, model, weights, tokenizer, POLICIES[policy], threads, precision, progress)
        except Exception as error:  # noqa: BLE001 - any failure to load falls through to the next
            ENGINE_LOADS[(name, "failed")] += 1
            if backend != "auto":
                raise
            log.warning("backend %s did not load (%s); trying the next", name, error)
            continue
        ENGINE_LOADS[(name, "loaded")] += 1
        captions = caption_policy(weights.twin or model)
        if not engine.batch_rows_cheap and captions and _shorter(POLICIES[captions], POLICIES[policy]):
            engine.caption_policy = POLICIES[captions]
        return engine
    raise AssertionError("onnxruntime is always the last resort")  # pragma: no cover


def _shorter(window: EncoderPolicy, than: EncoderPolicy) -> bool:
    """A cheaper window for a typical caption (3 s of speech)."""
    return window.frames(3 * SAMPLE_RATE) < than.frames(3 * SAMPLE_RATE)


def _engine(
    name: str, model: str, weights: Weights, tokenizer: WhisperTokenizer, policy: EncoderPolicy, threads: int,
    precision: str, progress: Callable[[str], None] | None,
) -> Engine:
    if name == "torch-cuda":
        from engines.gpu.engine import TorchCudaEngine

        return TorchCudaEngine(model, weights, tokenizer, policy)
    return StepEngine(model, create_backend(name, weights, threads, precision, progress), tokenizer, policy,
                      weights.dims.n_mels)


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
