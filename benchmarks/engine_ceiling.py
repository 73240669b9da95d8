"""Where a GPU worker's engine spends its time on the load simulator's clips, and how many
utterances a second it sustains: the figures behind the fleet's ceiling (benchmarks/README.md,
"The fleet's middle alone").

On a CUDA machine, after scaleout_device.sh has installed its payload (ENGINE=1 there runs this):
    python -m benchmarks.engine_ceiling --out DIR [--model tiny.en] [--policies pad30-zero min20s-zero]
    PYTHONPATH=OLD:$PYTHONPATH python -P -m benchmarks.engine_ceiling --out DIR/old   # OLD/engines: another build's

The clips go in as a worker hands them to the engine: the queue's int16 PCM (float32 for a build
whose engines take only that); `engines_from` in the results says which engines/ ran.

For each encoder policy: one engine, warmed up as a worker warms it; then per batch size the
phases of one batch (gpu_bench.phases: voicing, log-mel, encoder, decoding, each waited for)
and the whole batch's wall time as the worker calls it (transcribe_batch, p50 of --repeats);
for the first policy a kernel table of the largest batch, and (--rates) in-flight arrivals at a
sweep of rates (gpu_bench.inflight_sweep). Each batch's transcripts are kept, to compare builds.
Timing only: the policies' error rates are measured on the CPU (benchmarks/encoder_length.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.gpu_bench import _log, _sync, inflight_sweep, phases


def _clips() -> tuple[list[np.ndarray], str]:
    """The simulator's clips as a worker hands them to the engine: the queue's int16 PCM, or
    float32 for a build whose engines take only that (an older build's, ENGINE_OLD)."""
    import engines.features
    from streamserver.loadsim.scenario import load_clips

    pcm = [np.frombuffer(c.pcm, "<i2") for c in load_clips()]
    if hasattr(engines.features, "as_float"):
        return pcm, "int16"
    return [p.astype(np.float32) / 32768.0 for p in pcm], "float32"


def _batch(clips: list[np.ndarray], size: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [clips[i] for i in rng.integers(0, len(clips), size)]


def _whole_batch(engine: Any, audios: list[np.ndarray], repeats: int) -> tuple[float, list[str]]:
    """The batch's p50 seconds over `repeats` calls as the worker makes them, and its transcripts."""
    times = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        texts = [r.text for r in engine.transcribe_batch(audios, "en")]
        _sync()
        times.append(time.perf_counter() - t)
    return float(np.percentile(times, 50)), texts


def measure(model: str, policy: str, batches: list[int], repeats: int, rates: list[int], seconds: float,
            out: Path, first: bool, eager_too: bool = False, device: str = "cuda",
            save: Any = None) -> dict[str, Any]:
    """One policy's figures; `save(result)` after each batch, so that a run cut short keeps what it measured."""
    import torch

    from engines.gpu.engine import TorchCudaEngine

    started = time.perf_counter()
    # On cpu (a check of this script on a machine without a GPU) with fewer slots, to keep its caches small.
    engine = TorchCudaEngine.of_model(model, policy, device, **({} if device == "cuda" else {"slots": 64}))
    engine.warmup()
    result: dict[str, Any] = {"model": model, "policy": policy, "load_and_warmup_s": round(time.perf_counter() - started, 1),
                              "engines_from": str(Path(sys.modules[TorchCudaEngine.__module__].__file__ or "").parents[1])}
    _log(f"{model} {policy}: loaded and warmed up in {result['load_and_warmup_s']} s")
    clips, kind = _clips()
    result["clips"] = {"count": len(clips), "mean_s": round(float(np.mean([c.size for c in clips])) / 16000, 3), "audio": kind}
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    result["batches"] = rows
    for size in batches:
        audios = _batch(clips, size, rng)
        trace = out / f"kernels-{model}-{policy}-b{size}.txt" if first and size == max(batches) else None
        row = phases(engine, audios, "en", trace)
        p50, row["texts"] = _whole_batch(engine, audios, repeats)  # texts: to compare two builds' transcripts
        row["batch_p50_ms"] = round(p50 * 1000, 2)
        row["batch_utt_s"] = round(size / p50, 1)
        _log(f"{policy} batch {size}: {row['batch_p50_ms']} ms, {row['batch_utt_s']} utt/s")
        rows.append(row)
        if save:
            save(result)
    if eager_too and hasattr(engine, "_encode_fn"):
        # The same batches with the encoder uncompiled: its time, and whether compiling it
        # changed any transcript.
        engine._encode_fn, rng = engine.whisper.encode_layers, np.random.default_rng(0)
        engine._encoders.clear()
        result["eager_encoder"] = []
        for size, row in zip(batches, rows):
            audios = _batch(clips, size, rng)
            engine.transcribe_batch(audios, "en")  # captures its encoder graph
            p50, texts = _whole_batch(engine, audios, repeats)
            same = sum(a == b for a, b in zip(texts, row["texts"]))
            result["eager_encoder"].append({"batch": size, "batch_p50_ms": round(p50 * 1000, 2),
                                            "batch_utt_s": round(size / p50, 1), "same_texts": same})
            _log(f"{policy} batch {size}, encoder uncompiled: {p50 * 1000:.1f} ms; {same}/{size} transcripts as compiled")
            if save:
                save(result)
    if rates:
        result["inflight"] = inflight_sweep(engine, clips, tuple(rates), seconds)
    if torch.cuda.is_available():
        result["gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del engine
    torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="tiny.en")
    p.add_argument("--policies", nargs="+", default=["pad30-zero"])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rates", type=int, nargs="*", default=[], help="in-flight arrivals at these rates (utt/s)")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--device", default="cuda", help="cpu only to check the script itself")
    p.add_argument("--eager-too", action="store_true", help="the same batches again with the encoder uncompiled")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []

    def save(current: dict[str, Any]) -> None:
        (args.out / "engine-ceiling.json").write_text(json.dumps(results + [current], indent=1))

    for i, policy in enumerate(args.policies):
        results.append(measure(args.model, policy, args.batches, args.repeats, args.rates if i == 0 else [],
                               args.seconds, args.out, i == 0, args.eager_too, args.device, save))
        (args.out / "engine-ceiling.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
