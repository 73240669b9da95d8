"""What the TensorRT path does on a GPU machine, step by step, recorded as it goes.

For each model: build the portable ONNX graphs from the packaged weights, then for each graph
parse it (the parser's errors, the operators it says it cannot import) and, for each precision
and each set of optimization profiles (all of them, as the engine is built, then each alone),
build it (seconds, plan bytes or TensorRT's error), ask whether this GPU can run the plan
(get_engine_validity where the module has it) and try to load it. Nothing stops the run: a
failure is recorded and the next step goes on. The JSON is rewritten after every step, so a
run cut short by a timeout still leaves what it did.

Imports only numpy, onnx, the engines' graph/weights/profile modules and the TensorRT module
found (tensorrt, else tensorrt_rtx_bindings): it runs on a bare GPU machine without PyAV,
webrtcvad or the tokenizer.

  python -m benchmarks.trt_check --models base tiny.en --out trt-check.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from engines.graphs import GRAPH_VERSION, graph_paths
from engines.tensorrt import BackendUnavailable, current_gpu, import_tensorrt, is_strongly_typed
from engines.tensorrt.builder import FLAVOUR, BuildError, GraphBuild, check_precision, identity_for
from engines.tensorrt.device import collecting_logger
from engines.tensorrt.profiles import Profile, engine_profiles
from engines.tensorrt.runtime import engine_profiles_of
from engines.weights import load_weights


def _say(message: str) -> None:
    print(f"trt_check: {message}", file=sys.stderr, flush=True)


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Report:
    """The JSON file, rewritten whole (through a temporary name) after every step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": []}

    def row(self, **fields: Any) -> dict[str, Any]:
        self.data["rows"].append(fields)
        self.save()
        return fields

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def _describe_module(trt: Any) -> dict[str, Any]:
    parser_version = getattr(trt, "get_nv_onnx_parser_version", lambda: None)()
    return {
        "module": trt.__name__, "version": trt.__version__, "onnx_parser_version": parser_version,
        "strongly_typed": is_strongly_typed(trt), "builder_flags": sorted(trt.BuilderFlag.__members__),
        "int8_calibrator": hasattr(trt, "IInt8EntropyCalibrator2"),
        "compute_capabilities": sorted(trt.ComputeCapability.__members__) if hasattr(trt, "ComputeCapability") else None,
    }


def _validity(trt: Any, runtime: Any, plan: bytes) -> dict[str, Any] | None:
    """TensorRT-RTX can say whether a plan suits this GPU without loading it."""
    if not hasattr(runtime, "get_engine_validity"):
        return None
    validity, diagnostics = runtime.get_engine_validity(plan)
    flags = getattr(trt, "EngineInvalidityDiagnostics", None)
    try:
        raw: int | None = int(diagnostics)
    except (TypeError, ValueError):
        raw = None
    # The diagnostics are a bit field; which bit each enum value names is read as 1 << value.
    named = [n for n, v in flags.__members__.items() if raw is not None and raw & (1 << int(v))] if flags else None
    return {"validity": str(validity), "diagnostics": repr(diagnostics), "diagnostics_named": named}


def _load(trt: Any, plan: bytes, inputs: list[str]) -> dict[str, Any]:
    logger = collecting_logger(trt)
    mark = logger.count
    runtime = trt.Runtime(logger)
    result: dict[str, Any] = {}
    try:
        result["validity"] = _validity(trt, runtime, plan)
    except Exception as error:  # noqa: BLE001 - recorded, not fatal
        result["validity_error"] = _error(error)
    engine = runtime.deserialize_cuda_engine(plan)
    result["deserialize_ok"] = engine is not None
    if engine is not None:
        result["stored_profiles"] = [p.as_json() for p in engine_profiles_of(trt, engine, inputs)]
    result["deserialize_log"] = logger.since(mark)[-5:]
    return result


def _skip_reason(trt: Any, precision: str) -> str | None:
    try:
        check_precision(trt, precision)
    except BuildError as error:
        return str(error)
    if precision == "int8":
        return "int8 needs calibration audio and CUDA memory: `streamserver engine build` does it, this check does not"
    return None


def _check_graph(report: Report, trt: Any, model: str, graph: str, path: Path, profiles: list[Profile], args: argparse.Namespace) -> None:
    started = time.perf_counter()
    build = GraphBuild(trt, path, _say)
    try:
        build.parse()
        parsed = {"parse_ok": True, "inputs": [build.network.get_input(i).name for i in range(build.network.num_inputs)],
                  "layers": build.network.num_layers}
    except BuildError as error:
        parsed = {"parse_ok": False, "parse_error": str(error)}
    try:
        parsed["unsupported_operators"] = build.unsupported_operators()
    except Exception as error:  # noqa: BLE001
        parsed["unsupported_operators_error"] = _error(error)
    report.row(model=model, graph=graph, step="parse", seconds=round(time.perf_counter() - started, 2), **parsed)
    if not parsed["parse_ok"]:
        return
    sets = [("all", profiles)] + ([(p.name, [p]) for p in profiles] if len(profiles) > 1 else [])
    for precision in args.precisions:
        reason = _skip_reason(trt, precision)
        if reason:
            report.row(model=model, graph=graph, step="build", precision=precision, skipped=reason)
            continue
        for name, specs in sets:
            row: dict[str, Any] = {"model": model, "graph": graph, "step": "build", "precision": precision,
                                   "profiles": name, "shapes": [p.as_json() for p in specs]}
            mark = build.logger.count
            started = time.perf_counter()
            try:
                _say(f"{model} {graph} {precision} profiles={name}: building")
                plan = build.build(build.configure(specs, precision, args.workspace_gib))
                row |= {"build_ok": True, "build_s": round(time.perf_counter() - started, 2), "plan_bytes": len(plan)}
            except Exception as error:  # noqa: BLE001 - a failed build is a result
                row |= {"build_ok": False, "build_s": round(time.perf_counter() - started, 2), "build_error": _error(error)}
                plan = None
            row["build_log"] = build.logger.since(mark)[-8:]
            row = report.row(**row)
            if plan is not None:
                try:
                    row |= _load(trt, plan, [p for p in specs[0].shapes])
                except Exception as error:  # noqa: BLE001
                    row["deserialize_error"] = _error(error)
                report.save()


def run(args: argparse.Namespace) -> int:
    report = Report(Path(args.out))
    report.data |= {"python": sys.version.split()[0], "platform": platform.platform(), "graph_version": GRAPH_VERSION,
                    "graph_flavour": FLAVOUR, "max_batch": args.max_batch}
    try:
        trt = import_tensorrt()
    except BackendUnavailable as error:
        report.data["error"] = str(error)
        report.save()
        _say(str(error))
        return 1
    report.data |= _describe_module(trt)
    try:
        gpu = current_gpu()
        report.data["gpu"] = {"name": gpu.name, "compute_capability": gpu.compute_capability}
    except Exception as error:  # noqa: BLE001 - the builder may still work without one
        gpu = None
        report.data["gpu_error"] = _error(error)
    report.save()
    for model in args.models:
        started = time.perf_counter()
        try:
            weights = load_weights(model)
            paths = graph_paths(weights, FLAVOUR, _say)
            profiles = engine_profiles(weights.dims, model, args.max_batch)
        except Exception as error:  # noqa: BLE001
            report.row(model=model, step="graphs", error=_error(error), traceback=traceback.format_exc()[-2000:])
            continue
        row = report.row(model=model, step="graphs", seconds=round(time.perf_counter() - started, 2),
                         onnx_bytes={p.name: p.stat().st_size for p in paths})
        if gpu is not None:
            row["cache_key_fp16"] = identity_for(trt, gpu, weights, "fp16", profiles).key()
        for graph, path in zip(("encoder", "decoder"), paths):
            try:
                _check_graph(report, trt, model, graph, path, profiles[graph], args)
            except Exception as error:  # noqa: BLE001 - one graph's surprise must not end the run
                report.row(model=model, graph=graph, step="unexpected", error=_error(error),
                           traceback=traceback.format_exc()[-2000:])
    report.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    report.save()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["base", "tiny.en"])
    parser.add_argument("--precisions", nargs="+", default=["fp16", "fp32", "int8"],
                        help="each is built or recorded as skipped, with the reason")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--workspace-gib", type=int, default=8)
    parser.add_argument("--out", default="trt-check.json")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
