"""Portable ONNX graphs -> serialized TensorRT engines, cached per GPU kind (cache_key.py).

Precision: full TensorRT 10.x is weakly typed, so fp16 and int8 are builder flags over the fp32
graph (LayerNorm kept in fp32: its variance overflows fp16). TensorRT-RTX and TensorRT 11 are
strongly typed: the engine computes in the ONNX graph's own types, so from our fp32 portable
graph they build fp32 only; fp16 there needs an fp16 graph, int8 one with Q/DQ nodes.
int8 (TensorRT 10 only) calibrates the encoder with an entropy calibrator fed log-mel batches of
the user's speech; the decoder stays fp16 (its inputs are decoder states, not audio, and a step
is bound by launches and memory reads that int8 barely shortens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np

from engines.graphs import GRAPH_VERSION, graph_paths
from engines.tensorrt import BackendUnavailable, Gpu, current_gpu, import_tensorrt, is_strongly_typed
from engines.tensorrt.cache_key import EngineFiles, EngineIdentity, digest_files, engine_files, engines_dir, find_cached, write_sidecar
from engines.tensorrt.device import collecting_logger, cuda_api
from engines.tensorrt.profiles import Profile, ProfileSettings, engine_profiles
from engines.weights import Weights, load_weights

Progress = Callable[[str], None]
PRECISIONS = ("fp16", "int8", "fp32")
PRECISION = "fp16"  # of a build not asked for another
FLAVOUR = "portable"  # the graphs without ONNX Runtime's contrib ops
WORKSPACE_GIB = 8
CALIBRATION_BATCH = 8
AUDIO_SUFFIXES = {".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".webm", ".mp4"}


class BuildError(RuntimeError):
    """TensorRT could not parse or build a graph; the message carries TensorRT's own errors."""


def check_precision(trt: ModuleType, precision: str) -> None:
    """Refuse, before any slow work, a precision this TensorRT cannot build from our graphs."""
    if precision not in PRECISIONS:
        raise BuildError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if precision != "fp32" and is_strongly_typed(trt):
        raise BuildError(
            f"{trt.__name__} {trt.__version__} builds strongly typed networks, whose precision is the ONNX "
            f"graph's own types; the portable graph is fp32, so {precision} needs an {precision} graph "
            "that is not built yet (use --precision fp32)"
        )
    if precision == "int8" and not hasattr(trt, "IInt8EntropyCalibrator2"):
        raise BuildError(f"{trt.__name__} {trt.__version__} has no int8 entropy calibrator")


def _monitor(trt: ModuleType, progress: Progress) -> Any:
    class Monitor(trt.IProgressMonitor):
        """TensorRT's build phases as lines: top-level phases with their steps, sub-phases once."""

        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.depth: dict[str, int] = {}
            self.steps: dict[str, int] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            depth = self.depth.get(parent_phase, -1) + 1 if parent_phase else 0
            self.depth[phase_name], self.steps[phase_name] = depth, num_steps
            if depth <= 1:
                progress(f"{'  ' * depth}{phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name: str, step: int) -> bool:
            if self.depth.get(phase_name) == 0:
                progress(f"{phase_name}: {step + 1}/{self.steps[phase_name]}")
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            self.depth.pop(phase_name, None)

    return Monitor()


@dataclass
class GraphBuild:
    """One ONNX graph through TensorRT's builder. Holds every object TensorRT only borrows
    (logger, monitor, calibrator): freed early, they would crash the build."""

    trt: ModuleType
    onnx_path: Path
    progress: Progress | None = None
    logger: Any = None
    keep: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.logger = collecting_logger(self.trt)
        self.builder = self.trt.Builder(self.logger)
        self.network = self.builder.create_network(0)  # explicit batch: the only mode since TensorRT 10
        self.parser = self.trt.OnnxParser(self.network, self.logger)

    def parse(self) -> None:
        # From the file, not bytes: the parser then finds external weight files next to it.
        mark = self.logger.count
        if not self.parser.parse_from_file(str(self.onnx_path)):
            errors = [str(self.parser.get_error(i)) for i in range(self.parser.num_errors)] or self.logger.since(mark)
            raise BuildError(f"{self.onnx_path.name}: ONNX parse failed: {'; '.join(errors)}")

    def unsupported_operators(self) -> list[str]:
        """Operator types of the graph that this parser says it cannot import."""
        import onnx

        ops = {node.op_type for node in onnx.load(str(self.onnx_path), load_external_data=False).graph.node}
        return sorted(op for op in ops if not self.parser.supports_operator(op))

    def configure(
        self, profiles: Sequence[Profile], precision: str, workspace_gib: int = WORKSPACE_GIB,
        calibrator: Any = None, calibration_shape: tuple[int, ...] | None = None,
    ) -> Any:
        trt, config = self.trt, self.builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_gib << 30)
        if self.progress is not None and hasattr(trt, "IProgressMonitor"):
            monitor = _monitor(trt, self.progress)
            self.keep.append(monitor)
            config.progress_monitor = monitor
        for spec in profiles:
            profile = self.builder.create_optimization_profile()
            for name, r in spec.shapes.items():
                profile.set_shape(name, r.min, r.opt, r.max)
            config.add_optimization_profile(profile)
        if precision in ("fp16", "int8"):
            config.set_flag(trt.BuilderFlag.FP16)
            self._norms_in_fp32(config)
        if precision == "int8":
            config.set_flag(trt.BuilderFlag.INT8)
            self.keep.append(calibrator)
            config.int8_calibrator = calibrator
            # Calibration runs at one fixed shape: the calibrator's batches.
            fixed = self.builder.create_optimization_profile()
            fixed.set_shape("mel", calibration_shape, calibration_shape, calibration_shape)
            config.set_calibration_profile(fixed)
        return config

    def _norms_in_fp32(self, config: Any) -> None:
        trt = self.trt
        for i in range(self.network.num_layers):
            layer = self.network.get_layer(i)
            if layer.type == trt.LayerType.NORMALIZATION:
                layer.precision = trt.float32
                layer.set_output_type(0, trt.float32)
        if hasattr(trt.BuilderFlag, "PREFER_PRECISION_CONSTRAINTS"):
            config.set_flag(trt.BuilderFlag.PREFER_PRECISION_CONSTRAINTS)

    def build(self, config: Any) -> bytes:
        mark = self.logger.count
        plan = self.builder.build_serialized_network(self.network, config)
        if plan is None:
            why = " | ".join(self.logger.since(mark)[-5:]) or "no message from TensorRT"
            raise BuildError(f"{self.onnx_path.name}: TensorRT build failed: {why}")
        return bytes(memoryview(plan))


# --- int8 calibration ----------------------------------------------------------------------


def calibration_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES)
    if not files:
        raise BuildError(f"{folder}: no audio files ({', '.join(sorted(AUDIO_SUFFIXES))}) to calibrate with")
    return files


def calibration_batches(files: Sequence[Path], model: str, batch: int = CALIBRATION_BATCH) -> list[np.ndarray]:
    """Log-mel batches [batch, 80, frames] of the files, at the frames the engine will mostly see
    (the model's policy for a typical utterance), each file cut or padded to them."""
    from engines.audio import load_audio  # PyAV: only the int8 build reads audio files
    from engines.features import HOP_LENGTH, log_mel
    from engines.policy import POLICIES, default_policy
    from engines.tensorrt.profiles import settings_for

    frames = settings_for(model).opt_frames
    pad = POLICIES[default_policy(model)].pad_value
    mels = [log_mel(load_audio(f)[: frames * HOP_LENGTH], frames, pad) for f in files]
    batch = min(batch, len(mels))
    return [np.stack(mels[i : i + batch]) for i in range(0, len(mels) - batch + 1, batch)]


def _calibrator(trt: ModuleType, batches: list[np.ndarray], cache_path: Path) -> Any:
    cuda = cuda_api()

    class MelCalibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.next = 0
            self.device = cuda.alloc(batches[0].nbytes)

        def get_batch_size(self) -> int:
            return batches[0].shape[0]

        def get_batch(self, names: list[str]) -> list[int] | None:
            if self.next == len(batches):
                return None  # no more data: calibration ends
            with cuda.current():
                cuda.upload(self.device.ptr, batches[self.next])
                cuda.sync()
            self.next += 1
            return [self.device.ptr]  # one pointer per input; the encoder has one

        def read_calibration_cache(self) -> bytes | None:
            return cache_path.read_bytes() if cache_path.exists() else None

        def write_calibration_cache(self, cache: Any) -> None:
            cache_path.write_bytes(bytes(memoryview(cache)))

    return MelCalibrator()


# --- engines for a model -------------------------------------------------------------------


def identity_for(
    trt: ModuleType, gpu: Gpu, weights: Weights, precision: str, profiles: dict[str, list[Profile]],
    calibration_digest: str | None = None,
) -> EngineIdentity:
    return EngineIdentity(
        model=weights.name, weights_sha256=weights.sha256, graph_version=GRAPH_VERSION, graph_flavour=FLAVOUR,
        trt_module=trt.__name__, trt_version=trt.__version__, gpu_name=gpu.name,
        compute_capability=gpu.compute_capability, precision=precision, calibration_digest=calibration_digest,
        profiles={g: [p.as_json() for p in specs] for g, specs in profiles.items()},
    )


def build_engines(
    model: str, precision: str = PRECISION, calibration_dir: Path | None = None, max_batch: int = ProfileSettings.max_batch,
    progress: Progress | None = None, workspace_gib: int = WORKSPACE_GIB,
) -> EngineFiles:
    """`streamserver engine build`: the encoder and decoder engines of a packaged model for this
    GPU, from the cache, else built."""
    trt = import_tensorrt()  # first: where TensorRT is missing, nothing else is worth doing
    check_precision(trt, precision)
    if precision == "int8" and calibration_dir is None:
        raise BuildError("int8 needs representative speech to calibrate with: --calibration-dir DIR")
    gpu = current_gpu()
    return _engines(trt, gpu, load_weights(model), precision, calibration_dir, max_batch, progress, workspace_gib)


def _engines(
    trt: ModuleType, gpu: Gpu, weights: Weights, precision: str, calibration_dir: Path | None, max_batch: int,
    progress: Progress | None, workspace_gib: int,
) -> EngineFiles:
    say = progress or (lambda _: None)
    model = weights.name
    profiles = engine_profiles(weights.dims, model, max_batch)
    audio = calibration_files(Path(calibration_dir)) if precision == "int8" else []
    digest = digest_files(audio) if audio else None
    identity = identity_for(trt, gpu, weights, precision, profiles, digest)
    files, refused = find_cached(identity)
    if files is not None:
        say(f"TensorRT engines for {model} ({precision}, {gpu.name}) are cached: {files.sidecar}")
        return files
    for reason in refused:
        say(f"not reusing {reason}")
    files = engine_files(identity)
    encoder_onnx, decoder_onnx = graph_paths(weights, FLAVOUR, progress)
    for graph, onnx_path in (("encoder", encoder_onnx), ("decoder", decoder_onnx)):
        started = time.perf_counter()
        say(f"building the {graph} engine of {model} ({precision}) with {trt.__name__} {trt.__version__} on {gpu.name}")
        build = GraphBuild(trt, onnx_path, progress)
        build.parse()
        graph_precision, calibrator, shape = precision, None, None
        if precision == "int8" and graph == "encoder":
            batches = calibration_batches(audio, model)
            shape = batches[0].shape
            say(f"calibrating on {len(batches)} batches of {shape} from {len(audio)} files")
            cache = engines_dir() / f"{model}-{digest[:16]}-{shape[2]}.calib"
            calibrator = _calibrator(trt, batches, cache)
        elif precision == "int8":
            graph_precision = "fp16"
        plan = build.build(build.configure(profiles[graph], graph_precision, workspace_gib, calibrator, shape))
        tmp = files.plans[graph].with_suffix(".tmp")
        tmp.write_bytes(plan)
        tmp.replace(files.plans[graph])
        say(f"{graph} engine: {len(plan) / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s -> {files.plans[graph]}")
    write_sidecar(identity, files)
    return files


def ensure_engines(weights: Weights, precision: str, max_batch: int = ProfileSettings.max_batch, progress: Progress | None = None) -> EngineFiles:
    """What the runtime loads for the weights it has: cached engines for this GPU, else fp16/fp32
    ones built now. int8 needs the user's calibration audio, so only `streamserver engine build`
    makes it."""
    trt = import_tensorrt()
    check_precision(trt, precision)
    gpu = current_gpu()
    if precision != "int8":
        return _engines(trt, gpu, weights, precision, None, max_batch, progress, WORKSPACE_GIB)
    model = weights.name
    identity = identity_for(trt, gpu, weights, precision, engine_profiles(weights.dims, model, max_batch))
    files, refused = find_cached(identity, any_calibration=True)
    if files is None:
        why = f" ({'; '.join(refused)})" if refused else ""
        raise BackendUnavailable(
            f"no int8 TensorRT engine of {model} for this GPU{why}; build one with: streamserver engine build "
            f"--backend tensorrt --model {model} --precision int8 --calibration-dir DIR"
        )
    return files
