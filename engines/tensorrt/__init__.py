"""The TensorRT path, for users who have TensorRT: engines built from the portable ONNX graphs.

profiles.py (what shapes each engine is tuned for) -> cache_key.py (which GPU, TensorRT and
weights an engine belongs to) -> device.py (the shared TensorRT logger, CUDA memory and stream)
-> builder.py (ONNX -> serialized engine) -> runtime.py (the Backend). This module only finds
what is installed: the TensorRT module and the GPU's identity.
Nothing here imports TensorRT or CUDA at import time, so the CPU install never needs them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

# Full TensorRT 10.x first (weakly typed: fp16/int8 builder flags, entropy calibration); then
# TensorRT for RTX, which builds strongly typed networks only and runs on RTX-class GPUs.
TENSORRT_MODULES = ("tensorrt", "tensorrt_rtx_bindings")
INSTALL_HINT = (
    "pip install tensorrt (TensorRT 10.x, from NVIDIA's package index), or "
    "tensorrt-rtx-cu13-bindings + tensorrt-rtx-cu13-libs (TensorRT for RTX, Python 3.12)"
)


# One error for every backend that cannot run here (module or GPU missing); the message says why.
from engines.backends import BackendUnavailable  # noqa: E402


def import_tensorrt() -> ModuleType:
    """The first TensorRT module that imports, else one BackendUnavailable naming the fix."""
    reasons = []
    for name in TENSORRT_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as error:
            if not (isinstance(error, ModuleNotFoundError) and error.name == name):
                reasons.append(f"{name}: {error}")  # installed but broken, e.g. its libraries fail to load
    detail = f" ({'; '.join(reasons)})" if reasons else ""
    raise BackendUnavailable(f"TensorRT is not installed: {INSTALL_HINT}{detail}")


def is_strongly_typed(trt: ModuleType) -> bool:
    """True where the builder has no fp16 flag (TensorRT-RTX, TensorRT 11): an engine's precision
    is then the ONNX graph's own tensor types."""
    return not hasattr(trt.BuilderFlag, "FP16")


def import_cudart() -> ModuleType | None:
    """cuda-python's runtime API module (its name moved in cuda-python 12.6), or None."""
    for name in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


@dataclass(frozen=True)
class Gpu:
    name: str  # "NVIDIA H200"
    compute_capability: str  # "9.0"


def current_gpu(device: int = 0) -> Gpu:
    """The GPU an engine would be built for or run on: through pycuda, cuda-python or torch,
    whichever is installed (TensorRT itself does not say which GPU it sees)."""
    try:
        import pycuda.driver as driver
    except ImportError:
        driver = None
    if driver is not None:
        try:
            driver.init()
            d = driver.Device(device)
            return Gpu(d.name(), "{}.{}".format(*d.compute_capability()))
        except driver.Error as error:
            raise BackendUnavailable(f"no CUDA GPU {device} visible to pycuda: {error}") from error
    cudart = import_cudart()
    if cudart is not None:
        err, prop = cudart.cudaGetDeviceProperties(device)
        if err != cudart.cudaError_t.cudaSuccess:
            raise BackendUnavailable(f"no CUDA GPU {device} visible to cuda-python: {err!r}")
        name = prop.name.decode(errors="replace") if isinstance(prop.name, bytes) else str(prop.name)
        return Gpu(name.rstrip("\0").strip(), f"{prop.major}.{prop.minor}")
    try:
        import torch

        if torch.cuda.is_available():
            return Gpu(torch.cuda.get_device_name(device), "{}.{}".format(*torch.cuda.get_device_capability(device)))
    except ImportError:
        pass
    raise BackendUnavailable("no CUDA GPU found: TensorRT needs one, seen through pycuda, cuda-python or torch")
