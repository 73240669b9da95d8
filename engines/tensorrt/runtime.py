"""The TensorRT backend: the Backend interface (engines/backends) over serialized engines.

Untested on a GPU: nothing in this project's workplace can run it (full TensorRT cannot be
installed; TensorRT-RTX builds on the H200 but refuses to run on compute capability 9.0). It is
kept small and plain for that reason: one device allocation per tensor, caches that grow by the
decoder's own Concat (as on ONNX Runtime), every public call ending in a stream sync, so no
buffer is freed while a copy or kernel still uses it. The pieces that need no GPU (profile
choice, row runs) are tested anywhere (tests/test_tensorrt_*.py).

Device memory and the stream come from pycuda where it is installed (retaining the primary
context, which TensorRT's CUDA runtime shares), else from cuda-python.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from engines.tensorrt import BackendUnavailable, import_cudart, import_tensorrt
from engines.tensorrt.profiles import Profile, ShapeRange, pick
from engines.weights import Weights

Progress = Callable[[str], None]


# --- CUDA memory: pycuda or cuda-python ------------------------------------------------------


@dataclass(frozen=True)
class DeviceBuffer:
    ptr: int
    nbytes: int
    owner: Any  # frees the memory when the last reference goes


class _PyCuda:
    def __init__(self) -> None:
        import pycuda.driver as drv

        drv.init()
        self.drv = drv
        self.context = drv.Device(0).retain_primary_context()
        with self.current():
            self.stream = drv.Stream()
        self.stream_handle = int(self.stream.handle)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Driver-API contexts are per thread; the ASR worker calls from its own thread."""
        self.context.push()
        try:
            yield
        finally:
            self.drv.Context.pop()

    def alloc(self, nbytes: int) -> DeviceBuffer:
        allocation = self.drv.mem_alloc(max(nbytes, 1))
        return DeviceBuffer(int(allocation), nbytes, allocation)

    def upload(self, ptr: int, host: np.ndarray) -> None:
        self.drv.memcpy_htod_async(ptr, host, self.stream)

    def download(self, host: np.ndarray, ptr: int) -> None:
        self.drv.memcpy_dtoh_async(host, ptr, self.stream)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.drv.memcpy_dtod_async(dst, src, nbytes, self.stream)

    def sync(self) -> None:
        self.stream.synchronize()


class _CudaFree:
    def __init__(self, rt: ModuleType, ptr: int) -> None:
        self.rt, self.ptr = rt, ptr

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the module may be gone
            self.rt.cudaFree(self.ptr)


class _CudaPython:
    def __init__(self, rt: ModuleType) -> None:
        self.rt = rt
        self._check(rt.cudaSetDevice(0))
        self.stream = self._check(rt.cudaStreamCreate())
        self.stream_handle = int(self.stream)
        kinds = rt.cudaMemcpyKind
        self.h2d, self.d2h, self.d2d = kinds.cudaMemcpyHostToDevice, kinds.cudaMemcpyDeviceToHost, kinds.cudaMemcpyDeviceToDevice

    def _check(self, result: tuple) -> Any:
        """cuda-python returns (error, values...) instead of raising."""
        err, *values = result
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"CUDA error: {err!r}")
        return values[0] if values else None

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        self._check(self.rt.cudaSetDevice(0))  # the runtime API binds device 0's primary context per thread
        yield

    def alloc(self, nbytes: int) -> DeviceBuffer:
        ptr = int(self._check(self.rt.cudaMalloc(max(nbytes, 1))))
        return DeviceBuffer(ptr, nbytes, _CudaFree(self.rt, ptr))

    def upload(self, ptr: int, host: np.ndarray) -> None:
        self._check(self.rt.cudaMemcpyAsync(ptr, host.ctypes.data, host.nbytes, self.h2d, self.stream))

    def download(self, host: np.ndarray, ptr: int) -> None:
        self._check(self.rt.cudaMemcpyAsync(host.ctypes.data, ptr, host.nbytes, self.d2h, self.stream))

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._check(self.rt.cudaMemcpyAsync(dst, src, nbytes, self.d2d, self.stream))

    def sync(self) -> None:
        self._check(self.rt.cudaStreamSynchronize(self.stream))


def cuda_api() -> Any:
    """Device memory and one stream on GPU 0, through pycuda or else cuda-python."""
    try:
        import pycuda.driver  # noqa: F401
    except ImportError:
        rt = import_cudart()
        if rt is None:
            raise BackendUnavailable("the TensorRT backend needs pycuda or cuda-python (pip install cuda-python)") from None
        return _CudaPython(rt)
    return _PyCuda()


# --- tensors and engines ---------------------------------------------------------------------


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

    def __init__(
        self, weights: Weights, threads: int = 0, precision: str = "fp16", progress: Progress | None = None,
        max_batch: int = 64,
    ) -> None:
        """threads: unused (the GPU does the work); kept for the Backend constructor's signature."""
        from engines.tensorrt.builder import collecting_logger, ensure_engines

        trt = import_tensorrt()
        files = ensure_engines(weights.name, precision, max_batch, progress)
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
