"""The intent labels on a GPU (streamserver/intent/e5_torch.py, fp16) against the CPU embedder
(ONNX Runtime) in the same run: agreement of labels and embeddings on every text of the intent
data set, and the time to label a batch of finals, as a busy worker does (64 at a time), with
the CPU time each costs the host. Writes JSON (default benchmarks/results/intent-gpu.json).

    python -m benchmarks.intent_gpu [--device cuda] [--threads 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamserver.intent.e5_onnx import OnnxE5Embedder  # noqa: E402
from streamserver.intent.e5_torch import TorchE5Embedder  # noqa: E402
from streamserver.intent.model import EmbeddingIntentClassifier  # noqa: E402
from benchmarks.intent.train import load  # noqa: E402

BATCH = 64


def _timed(classifier: EmbeddingIntentClassifier, batches: list[list[str]]) -> dict:
    classifier.classify(batches[0])  # warm
    wall, cpu = [], []
    for batch in batches:
        w, c = time.perf_counter(), time.process_time()
        classifier.classify(batch)
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return {"batch_wall_ms_p50": round(1000 * float(np.median(wall)), 2), "batch_cpu_ms_p50": round(1000 * float(np.median(cpu)), 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int, default=4, help="the CPU embedder's threads (the worker's default on the GPU host)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "intent-gpu.json")
    args = p.parse_args()
    texts = [t for split in ("train", "dev", "test") for t in load(split)[0]]  # every text of the data set
    cpu = EmbeddingIntentClassifier(embedder=OnnxE5Embedder(threads=args.threads))
    gpu = EmbeddingIntentClassifier(embedder=TorchE5Embedder(args.device))
    a, b = cpu.embedder.embed(texts), gpu.embedder.embed(texts)
    cosine = (a * b).sum(axis=1)
    la, lb = cpu.classify(texts), gpu.classify(texts)
    batches = [texts[i : i + BATCH] for i in range(0, len(texts) - BATCH + 1, BATCH)]
    result = {
        "texts": len(texts), "device": args.device, "cpu_threads": args.threads,
        "cosine_min": round(float(cosine.min()), 5), "cosine_mean": round(float(cosine.mean()), 5),
        "same_label": round(sum(x.label == y.label for x, y in zip(la, lb)) / len(texts), 4),
        "score_diff_max": round(max(abs(x.score - y.score) for x, y in zip(la, lb)), 4),
        "batch": BATCH, "cpu": _timed(cpu, batches), "gpu": _timed(gpu, batches),
    }
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
