"""The TensorRT backend (engines/tensorrt/runtime.py).

Three kinds of check: where TensorRT is missing, choosing it fails with one clear error; the
runtime's own logic (profile choice, chunks of the largest batch, empty caches, kept rows, the
token-by-token fallback) runs against a stand-in for TensorRT and CUDA that executes the same
portable graphs on ONNX Runtime and keeps "device memory" in host buffers; and, where TensorRT
and a CUDA GPU exist, real engines against the CPU backend (skipped elsewhere, with the reason).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from engines.backends.onnxruntime import OnnxRuntimeBackend, new_session
from engines.engine import StepEngine as Engine  # the Engine over a step-by-step Backend
from engines.features import log_mel
from engines.graphs import graph_paths
from engines.policy import POLICIES, default_policy
from engines.tensorrt import BackendUnavailable, current_gpu, import_tensorrt, is_strongly_typed
from engines.tensorrt import builder, runtime
from engines.tensorrt.cache_key import EngineFiles
from engines.tensorrt.profiles import engine_profiles
from engines.tensorrt.device import DeviceBuffer
from engines.tensorrt.runtime import TensorRTBackend, row_runs
from engines.tokenizer import WhisperTokenizer
from engines.weights import Weights, load_weights


def _missing_reason() -> str | None:
    """Why real TensorRT engines cannot run here, or None where they can."""
    try:
        import_tensorrt()
        current_gpu()
    except Exception as error:  # noqa: BLE001 - any failure to find them is the skip reason
        return str(error)
    return None


MISSING = _missing_reason()


# --- where TensorRT is missing --------------------------------------------------------------


def _tensorrt_installed() -> bool:
    try:
        import_tensorrt()
    except BackendUnavailable:
        return False
    return True


@pytest.mark.skipif(_tensorrt_installed(), reason="TensorRT is installed here: the missing-TensorRT error cannot show")
def test_engine_build_without_tensorrt_says_so_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "streamserver", "engine", "build", "--backend", "tensorrt", "--model", "tiny.en",
         "--precision", "fp16"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "TensorRT is not installed" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.skipif(_tensorrt_installed(), reason="TensorRT is installed here: the missing-TensorRT error cannot show")
def test_choosing_the_backend_without_tensorrt_raises_backend_unavailable():
    with pytest.raises(BackendUnavailable, match="TensorRT is not installed"):
        TensorRTBackend(types.SimpleNamespace(name="tiny.en"), 2, "fp16")


def test_row_runs_copy_consecutive_rows_at_once():
    assert row_runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (5, 3, 2), (9, 5, 1)]
    assert row_runs([3]) == [(3, 0, 1)] and row_runs([]) == []
    assert row_runs([2, 1]) == [(2, 0, 1), (1, 1, 1)]


# --- the runtime's logic against a stand-in ------------------------------------------------


class FakeCuda:
    """Device memory as host buffers at made-up addresses, so pointer arithmetic is checked."""

    stream_handle = 7

    def __init__(self) -> None:
        self.blocks: dict[int, bytearray] = {}
        self.next = 1 << 20

    def current(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def alloc(self, nbytes: int) -> DeviceBuffer:
        ptr, self.next = self.next, self.next + nbytes + 4096  # a gap: an overrun lands nowhere
        self.blocks[ptr] = bytearray(max(nbytes, 1))
        return DeviceBuffer(ptr, nbytes, None)

    def view(self, ptr: int, nbytes: int) -> memoryview:
        base = max(b for b in self.blocks if b <= ptr)
        assert ptr - base + nbytes <= len(self.blocks[base]), "access past the end of an allocation"
        return memoryview(self.blocks[base])[ptr - base : ptr - base + nbytes]

    def upload(self, ptr: int, host: np.ndarray) -> None:
        self.view(ptr, host.nbytes)[:] = np.ascontiguousarray(host).tobytes()

    def download(self, host: np.ndarray, ptr: int) -> None:
        host.reshape(-1).view(np.uint8)[:] = np.frombuffer(self.view(ptr, host.nbytes), np.uint8)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.view(dst, nbytes)[:] = bytes(self.view(src, nbytes))

    def sync(self) -> None:
        pass


class FakeContext:
    def __init__(self, engine: "FakeEngine") -> None:
        self.engine, self.profile, self.shapes, self.addresses = engine, 0, {}, {}

    def set_optimization_profile_async(self, index: int, stream: int) -> None:
        self.profile = index

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None:
        self.shapes[name] = tuple(shape)

    def set_tensor_address(self, name: str, ptr: int) -> None:
        self.addresses[name] = ptr

    def _outputs(self) -> dict[str, np.ndarray]:
        assert self.engine.profiles[self.profile].covers(self.shapes), "shapes outside this context's profile"
        feeds = {}
        for name, shape in self.shapes.items():
            dtype = self.engine.dtypes[name]
            size = int(np.prod(shape)) * dtype.itemsize
            feeds[name] = np.frombuffer(self.engine.cuda.view(self.addresses[name], size), dtype).reshape(shape).copy()
        return dict(zip(self.engine.outputs, self.engine.session.run(None, feeds)))

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._outputs()[name].shape

    def execute_async_v3(self, stream: int) -> bool:
        assert stream == FakeCuda.stream_handle
        for name, value in self._outputs().items():
            self.engine.cuda.upload(self.addresses[name], value)
        return True


class FakeEngine:
    """A 'plan' that names an ONNX file and the profiles TensorRT would have stored."""

    def __init__(self, plan: bytes, cuda: FakeCuda) -> None:
        spec = json.loads(plan)
        self.cuda = cuda
        self.session = new_session(spec["onnx"], threads=2)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.dtypes = {n: np.dtype(np.int64 if n == "tokens" else np.float32) for n in self.inputs + self.outputs}
        weights = load_weights(spec["model"])
        self.profiles = engine_profiles(weights.dims, spec["model"], spec["max_batch"])[spec["graph"]]
        self.num_io_tensors = len(self.dtypes)
        self.num_optimization_profiles = len(self.profiles)

    def get_tensor_name(self, i: int) -> str:
        return (self.inputs + self.outputs)[i]

    def get_tensor_mode(self, name: str) -> str:
        return "input" if name in self.inputs else "output"

    def get_tensor_dtype(self, name: str) -> np.dtype:
        return self.dtypes[name]

    def get_tensor_profile_shape(self, name: str, index: int) -> list[tuple[int, ...]]:
        r = self.profiles[index].shapes[name]
        return [r.min, r.opt, r.max]

    def create_execution_context(self) -> FakeContext:
        return FakeContext(self)


@pytest.fixture
def fake_tensorrt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> int:
    """TensorRTBackend over the stand-ins, with engines of max batch 2 (so batches of 3 chunk)."""
    max_batch = 2
    cuda = FakeCuda()
    trt = types.ModuleType("fake_tensorrt")
    trt.__version__ = "0"
    trt.ILogger = type("ILogger", (), {"__init__": lambda self: None, "Severity": types.SimpleNamespace(WARNING=2)})
    trt.TensorIOMode = types.SimpleNamespace(INPUT="input", OUTPUT="output")
    trt.nptype = lambda dtype: dtype
    trt.Runtime = lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda plan: FakeEngine(plan, cuda))

    def ensure_engines(weights: Weights, precision: str, max_batch_: int, progress: object) -> EngineFiles:
        plans, model = {}, weights.name
        for graph, onnx_path in zip(("encoder", "decoder"), graph_paths(weights, "portable")):
            plans[graph] = tmp_path / f"{model}.{graph}.plan"
            plans[graph].write_text(json.dumps({"onnx": str(onnx_path), "model": model, "graph": graph, "max_batch": max_batch}))
        return EngineFiles(tmp_path / f"{model}.json", plans)

    monkeypatch.setattr(runtime, "import_tensorrt", lambda: trt)
    monkeypatch.setattr(runtime, "cuda_api", lambda: cuda)
    monkeypatch.setattr(builder, "ensure_engines", ensure_engines)
    return max_batch


def _close(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == np.float32 and a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=2e-3, rtol=1e-3)
    assert (a.argmax(axis=-1) == b.argmax(axis=-1)).all()


def test_runtime_steps_like_onnx_runtime_on_the_same_graphs(fake_tensorrt: int, librivox):
    weights = load_weights("tiny.en")
    reference = OnnxRuntimeBackend(weights, 2, "portable")
    backend = TensorRTBackend(weights, 2, "fp16")
    mel = np.stack([log_mel(audio[: 10 * 16000], 1000, 0.0) for _, audio, _ in librivox[:3]])  # 3 rows > max 2
    want, got = reference.encode(mel), backend.encode(mel)
    rng = np.random.default_rng(0)
    head = np.array([[50360, *rng.integers(0, 50000, 223), 50257]] * 3)  # a full prompt: the prefill's largest n
    for tokens in (head, np.array([[50362, 440, 1049]] * 3)):  # past 225 + 3: no profile, token by token
        (w_logits, want), (g_logits, got) = reference.step(tokens, want), backend.step(tokens, got)
        _close(g_logits, w_logits)
    again, _ = backend.step(np.array([[11]] * 3), got)  # the state is not changed by stepping it
    for token in (11, 262, 13):
        (w_logits, want), (g_logits, got) = reference.step(np.array([[token]] * 3), want), backend.step(np.array([[token]] * 3), got)
        if token == 11:
            _close(again, g_logits)
        _close(g_logits, w_logits)
    rows = np.array([0, 2])
    want, got = reference.keep(want, rows), backend.keep(got, rows)
    (w_logits, _), (g_logits, _) = reference.step(np.array([[290]] * 2), want), backend.step(np.array([[290]] * 2), got)
    _close(g_logits, w_logits)
    assert got.self_kv["self_k_0"].shape == (2, 6, 231, 64) and got.cross_kv["cross_v_3"].shape == (2, 6, 500, 64)


def test_transcripts_through_the_runtime_equal_onnx_runtimes(fake_tensorrt: int, librivox):
    weights = load_weights("tiny.en")
    tokenizer = WhisperTokenizer.load(weights.folder, weights.config, weights.dims.n_vocab)
    policy = POLICIES["min10s-zero"]  # 1000 frames: a third of the stand-in's work at 30 s
    audios = [audio for _, audio, _ in librivox[:3]]
    via_trt = Engine("tiny.en", TensorRTBackend(weights, 2, "fp16"), tokenizer, policy).transcribe_batch(audios, "en")
    via_ort = Engine("tiny.en", OnnxRuntimeBackend(weights, 2, "portable"), tokenizer, policy).transcribe_batch(audios, "en")
    assert [t.text for t in via_trt] == [t.text for t in via_ort] and all(t.text for t in via_trt)


# --- real engines, where TensorRT and a CUDA GPU exist --------------------------------------


@pytest.mark.skipif(MISSING is not None, reason=f"needs TensorRT and a CUDA GPU: {MISSING}")
def test_real_engines_transcribe_like_the_cpu_backend(librivox):
    trt = import_tensorrt()
    precision = "fp32" if is_strongly_typed(trt) else "fp16"  # TensorRT-RTX builds our fp32 graph as fp32
    weights = load_weights("tiny.en")
    try:
        backend = TensorRTBackend(weights, 2, precision)
    except BackendUnavailable as error:
        if "compute capabilit" in str(error):  # TensorRT-RTX on a data-centre GPU (the H200: 9.0)
            pytest.skip(f"this TensorRT cannot run on this GPU: {error}")
        raise
    tokenizer = WhisperTokenizer.load(weights.folder, weights.config, weights.dims.n_vocab)
    policy = POLICIES[default_policy("tiny.en")]
    audios = [audio for _, audio, _ in librivox[:4]]
    gpu = Engine("tiny.en", backend, tokenizer, policy).transcribe_batch(audios, "en")
    cpu = Engine("tiny.en", OnnxRuntimeBackend(weights, 2, "fp32"), tokenizer, policy).transcribe_batch(audios, "en")
    for g, c in zip(gpu, cpu):
        if precision == "fp32":
            assert g.text == c.text
        else:  # fp16 may change a token; not a transcript
            assert difflib.SequenceMatcher(None, g.text.split(), c.text.split()).ratio() >= 0.9, (g.text, c.text)
