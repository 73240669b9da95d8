"""What the TensorRT builder and runtime share: the process's TensorRT logger, and device memory
and one stream on GPU 0.

Device memory and the stream come from pycuda where it is installed (retaining the primary
context, which TensorRT's CUDA runtime shares), else from cuda-python.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any, Iterator

import numpy as np

from engines.tensorrt import BackendUnavailable, import_cudart

# --- the TensorRT logger ---------------------------------------------------------------------


@lru_cache(maxsize=None)
def collecting_logger(trt: ModuleType) -> Any:
    """The process's one TensorRT logger: TensorRT keeps the first logger it is given and
    ignores later ones, so builders and runtimes must all share it."""

    class Collecting(trt.ILogger):
        """Keeps the latest warnings and errors, so that a failed build or load can say why."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.recent: deque[str] = deque(maxlen=100)
            self.count = 0  # messages ever logged: a mark for since()

        def log(self, severity: Any, msg: str) -> None:
            if int(severity) <= int(trt.ILogger.Severity.WARNING):
                self.recent.append(f"{str(severity).rsplit('.', 1)[-1]}: {msg}")
                self.count += 1

        def since(self, mark: int) -> list[str]:
            new = min(self.count - mark, len(self.recent))
            return list(self.recent)[len(self.recent) - new :]

    return Collecting()


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
