"""A `streamserver worker` whose engine and sentence embedder are stand-ins: the worker's own work
(its queue calls, events, labels' text features, question groups, logs) measured alone, on any
machine, against a GPU worker's timing.

    .venv/bin/python -m benchmarks.stub_worker --redis-url URL --name worker-0 --metrics-port 9000 \\
        [--engine-s 0.065] [--labels-s 0.015] [--max-batch 64]

The engine answers each of the load simulator's clips with its reference text (known by its
length), after sleeping `--engine-s` a batch: a GPU's time, in which the worker thread holds no
core, as a GPU engine's thread waits on its device. Its rows are cheap (batch_rows_cheap), as a
GPU engine's, so the worker batches as it does on the GPU host. The intent labels are the real
classifier over a stand-in embedder that does what the GPU embedder (intent/e5_torch.py) does
on the host's CPU, tokenizing each text, and then sleeps `--labels-s` for the GPU's part and
returns a vector of the text's hash. The worker itself (asr/worker.py, queue/redis_queue.py,
asr/worker_process.py) is the real one: `benchmarks/inject.py --stub-engine` starts these.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import time
from typing import Sequence

import numpy as np

from engines.engine import Engine, Transcript

BATCH_S_GPU = 0.065  # tiny.en on the H200: 64 rows (benchmarks/results/inject-h200, worker logs)
LABELS_S_GPU = 0.015  # e5 on the H200: a batch's labels


class StubEngine(Engine):
    """Each clip's reference text after `batch_s` of sleep per batch (no CPU held)."""

    batch_rows_cheap = True

    def __init__(self, batch_s: float) -> None:  # noqa: D107 - no tokenizer, no weights
        from streamserver.loadsim.scenario import load_clips

        self.model, self.batch_s = "stub", batch_s
        self.texts = {len(c.pcm) // 2: c.text for c in load_clips()}

    @property
    def multilingual(self) -> bool:
        return False

    def transcribe_batch(self, audios: Sequence[np.ndarray], language: str | None = None, prompt: str | None = None,
                         fallback: bool = True, window: object = None) -> list[Transcript]:
        time.sleep(self.batch_s)
        return [Transcript(self.texts.get(a.size, "I have a question about the second step."), "en", 0.01, -0.2, 1.2, 1500)
                for a in audios]

    def _run(self, audios, frames, language, prompt):  # noqa: ANN001, ANN202 - never called
        raise NotImplementedError


class StubEmbedder:
    """The GPU embedder's host-side work (tokenizing into e5 windows), then `seconds` of sleep;
    a unit vector from each text's hash."""

    def __init__(self, seconds: float) -> None:
        from streamserver.intent import e5_file
        from streamserver.intent.e5_tokenizer import E5Tokenizer

        f = e5_file.read()
        self.tokenizer, self.seconds = E5Tokenizer(f.tokenizer, f.dims.max_positions), seconds

    def embed(self, texts: list[str]) -> np.ndarray:
        from streamserver.intent.e5_windows import text_windows

        text_windows(self.tokenizer, texts)
        time.sleep(self.seconds)
        out = np.stack([np.random.default_rng(int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little"))
                        .standard_normal(384).astype(np.float32) for t in texts])
        return out / np.linalg.norm(out, axis=1, keepdims=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--engine-s", type=float, default=BATCH_S_GPU, help="seconds a batch holds the stand-in engine")
    p.add_argument("--labels-s", type=float, default=LABELS_S_GPU, help="seconds a batch's labels hold the stand-in embedder")
    p.add_argument("--max-batch", type=int, default=64)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from streamserver.asr import worker_process
    from streamserver.intent.model import EmbeddingIntentClassifier

    intent = EmbeddingIntentClassifier(embedder=StubEmbedder(args.labels_s))
    worker_process.main(StubEngine(args.engine_s), intent, args.redis_url, args.max_batch, args.name, "127.0.0.1",
                        args.metrics_port)


if __name__ == "__main__":
    main()
