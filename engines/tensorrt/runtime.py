"""The TensorRT backend: the Backend interface (engines/backends) over serialized engines.

Untested on a GPU: nothing in this project's workplace can run it (full TensorRT cannot be
installed; TensorRT-RTX builds on the H200 but refuses to run on compute capability 9.0). It is
kept small and plain for that reason: one device allocation per tensor, caches that grow by the
decoder's own Concat (as on ONNX Runtime), every public call ending in a stream sync, so no
buffer is freed while a copy or kernel still uses it. The pieces that need no GPU (profile
choice, row runs) are tested anywhere (tests/test_tensorrt_*.py).

Device memory, the stream and the logger come from device.py; the engine files from builder.py
(cached for this GPU, else built on first use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Sequence

import numpy as np

from engines.tensorrt import BackendUnavailable, builder, import_tensorrt
from engines.tensorrt.builder import Progress
from engines.tensorrt.device import DeviceBuffer, collecting_logger, cuda_api
from engines.tensorrt.profiles import Profile, ProfileSettings, ShapeRange, pick
from engines.weights import Weights


@dataclass(frozen=True)
class DeviceTensor:
    buffer: DeviceBuffer
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def row_ptr(self, row: int) -> int:
        return self.buffer.ptr + row * self.row_bytes


def row_runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(source row, destination row, count) for each run of consecutive rows: one copy per run."""
    runs: list[tuple[int, int, int]] = []
    for dst, src in enumerate(int(r) for r in rows):
        if runs and runs[-1][0] + runs[-1][2] == src:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def deserialize(trt: ModuleType, runtime: Any, plan: bytes, logger: Any) -> Any:
    mark = logger.count
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:  # e.g. built for another GPU kind or TensorRT version
        raise BackendUnavailable(f"TensorRT refused the engine: {' | '.join(logger.since(mark)[-3:]) or 'no message'}")
    return engine


def engine_profiles_of(trt: ModuleType, engine: Any, inputs: Sequence[str]) -> list[Profile]:
    """The profiles as the engine stores them: the truth, whatever the sidecar says."""
    return [
        Profile(str(i), {n: ShapeRange(*(tuple(s) for s in engine.get_tensor_profile_shape(n, i))) for n in inputs})
        for i in range(engine.num_optimization_profiles)
    ]


class _Engine:
    """One engine with an execution context per profile; runs batches of any size in chunks of
    the profiles' largest batch, each chunk reading and writing its rows of the whole tensors."""

    def __init__(self, trt: ModuleType, runtime: Any, plan: bytes, logger: Any, cuda: Any) -> None:
        self.cuda, self.logger = cuda, logger
        self.engine = deserialize(trt, runtime, plan, logger)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in names}
        self.profiles = engine_profiles_of(trt, self.engine, self.inputs)
        self.max_batch = min(p.shapes[self.inputs[0]].max[0] for p in self.profiles)
        self.contexts = []
        for i in range(len(self.profiles)):
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(i, cuda.stream_handle)
            self.contexts.append(context)
        self.empty = cuda.alloc(256)  # an address for tensors of no elements (past = 0)

    def accepts(self, shapes: Mapping[str, Sequence[int]]) -> bool:
        chunk = {n: (min(s[0], self.max_batch), *s[1:]) for n, s in shapes.items()}
        return pick(self.profiles, chunk) is not None

    def _address(self, tensor: DeviceTensor, row: int) -> int:
        return tensor.row_ptr(row) if math.prod(tensor.shape) else self.empty.ptr

    def run(self, feeds: Mapping[str, DeviceTensor]) -> dict[str, DeviceTensor]:
        batch = feeds[self.inputs[0]].shape[0]
        outputs: dict[str, DeviceTensor] = {}
        for start in range(0, batch, self.max_batch):
            rows = min(self.max_batch, batch - start)
            shapes = {n: (rows, *feeds[n].shape[1:]) for n in self.inputs}
            index = pick(self.profiles, shapes)
            if index is None:
                raise ValueError(f"no optimization profile admits {shapes}")
            context = self.contexts[index]
            for n in self.inputs:
                context.set_input_shape(n, shapes[n])
                context.set_tensor_address(n, self._address(feeds[n], start))
            if not outputs:  # shapes resolve once every input shape is set
                for n in self.outputs:
                    shape = (batch, *tuple(context.get_tensor_shape(n))[1:])
                    size = math.prod(shape) * self.dtypes[n].itemsize
                    outputs[n] = DeviceTensor(self.cuda.alloc(size), shape, self.dtypes[n])
            for n in self.outputs:
                context.set_tensor_address(n, self._address(outputs[n], start))
            mark = self.logger.count
            if not context.execute_async_v3(self.cuda.stream_handle):
                raise RuntimeError(f"TensorRT run failed: {' | '.join(self.logger.since(mark)[-3:])}")
        return outputs


@dataclass(frozen=True)
class DecoderState:
    """Never changed once made: decoding may step the same state twice (language detection)."""

    self_kv: dict[str, DeviceTensor]  # self_k_i / self_v_i [batch, heads, past, head_dim]
    cross_kv: dict[str, DeviceTensor]  # cross_k_i / cross_v_i [batch, heads, ctx, head_dim]


class TensorRTBackend:
    name = "tensorrt"
    batch_rows_cheap = True  # a GPU's (engines/engine.py)

    def __init__(
        self, weights: Weights, threads: int = 0, precision: str = builder.PRECISION, progress: Progress | None = None,
        max_batch: int = ProfileSettings.max_batch,
    ) -> None:
        """threads: unused (the GPU does the work); kept for the Backend constructor's signature."""
        trt = import_tensorrt()
        files = builder.ensure_engines(weights, precision, max_batch, progress)
        self.cuda = cuda_api()
        self.logger = collecting_logger(trt)
        self.n_text_ctx = weights.dims.n_text_ctx
        with self.cuda.current():
            self.runtime = trt.Runtime(self.logger)
            self.encoder = _Engine(trt, self.runtime, Path(files.plans["encoder"]).read_bytes(), self.logger, self.cuda)
            self.decoder = _Engine(trt, self.runtime, Path(files.plans["decoder"]).read_bytes(), self.logger, self.cuda)

    def _upload(self, array: np.ndarray, dtype: np.dtype) -> DeviceTensor:
        host = np.ascontiguousarray(array, dtype=dtype)
        tensor = DeviceTensor(self.cuda.alloc(host.nbytes), host.shape, host.dtype)
        self.cuda.upload(tensor.buffer.ptr, host)
        self.cuda.sync()  # host is pageable and local: done with it before returning
        return tensor

    def encode(self, mel: np.ndarray) -> DecoderState:
        with self.cuda.current():
            cross = self.encoder.run({"mel": self._upload(mel, self.encoder.dtypes["mel"])})
            self.cuda.sync()
        batch = mel.shape[0]
        some = next(iter(cross.values()))
        empty_shape = (batch, some.shape[1], 0, some.shape[3])
        self_kv = {
            n: DeviceTensor(self.decoder.empty, empty_shape, self.decoder.dtypes[n])
            for n in self.decoder.inputs if n.startswith("self_")
        }
        return DecoderState(self_kv, cross)

    def step(self, tokens: np.ndarray, state: DecoderState) -> tuple[np.ndarray, DecoderState]:
        tokens = np.asarray(tokens)
        past = state.self_kv["self_k_0"].shape[2]
        if past + tokens.shape[1] > self.n_text_ctx:
            raise ValueError(f"{past} cached + {tokens.shape[1]} new positions exceed the decoder's {self.n_text_ctx}")
        shapes = {"tokens": tokens.shape, **{n: t.shape for n, t in {**state.self_kv, **state.cross_kv}.items()}}
        if tokens.shape[1] > 1 and not self.decoder.accepts(shapes):
            # Outside every profile (a long prompt's task prefix): one token at a time gives
            # the same last logits, since each position only attends to those before it.
            for j in range(tokens.shape[1]):
                logits, state = self.step(tokens[:, j : j + 1], state)
            return logits, state
        with self.cuda.current():
            feeds = {"tokens": self._upload(tokens, self.decoder.dtypes["tokens"]), **state.self_kv, **state.cross_kv}
            out = self.decoder.run(feeds)
            logits = np.empty(out["logits"].shape, out["logits"].dtype)
            self.cuda.download(logits, out["logits"].buffer.ptr)
            self.cuda.sync()
        self_kv = {n.removeprefix("new_"): t for n, t in out.items() if n.startswith("new_")}
        return logits.astype(np.float32, copy=False), DecoderState(self_kv, state.cross_kv)

    def keep(self, state: DecoderState, rows: np.ndarray) -> DecoderState:
        runs = row_runs(rows)
        with self.cuda.current():
            def take(t: DeviceTensor) -> DeviceTensor:
                shape = (len(rows), *t.shape[1:])
                if not t.row_bytes:
                    return DeviceTensor(t.buffer, shape, t.dtype)
                kept = DeviceTensor(self.cuda.alloc(len(rows) * t.row_bytes), shape, t.dtype)
                for src, dst, count in runs:
                    self.cuda.copy(kept.row_ptr(dst), t.row_ptr(src), count * t.row_bytes)
                return kept

            state = DecoderState({n: take(t) for n, t in state.self_kv.items()}, {n: take(t) for n, t in state.cross_kv.items()})
            self.cuda.sync()
        return state
