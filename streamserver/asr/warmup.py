"""Warming a GPU worker up on the path live traffic takes, before it says it is ready.

A GPU loads each of its kernels on first use (CUDA's lazy module loading, read from disk on a
machine just started) and plans each new shape once. The engine's own warm-up covers its batch
sizes on noise; live traffic also decodes real speech and labels its texts. On the H200 host the
first 4,000-student run after the machine started had its worker's first speculations take
0.54-0.80 s a batch (its slow-batch log), where later runs' took a few hundredths: every final of
those first seconds waited. So the worker recognises real speech (the load simulator's shipped
clips) at every batch size it makes and labels the texts, as a live batch does.
"""

from __future__ import annotations

import numpy as np

from engines.audio import load_audio
from engines.engine import Engine
from streamserver.intent import IntentClassifier
from streamserver.loadsim.scenario import CLIPS_DIR

BATCH_SIZES = (1, 2, 3, 4, 8, 16, 32, 64)


def warm_live_path(engine: Engine, intent: IntentClassifier | None, max_batch: int = BATCH_SIZES[-1]) -> None:
    clips = [load_audio(path) for path in sorted(CLIPS_DIR.glob("*.wav"))]
    if not clips:
        return
    for size in (s for s in BATCH_SIZES if s <= max_batch):
        batch: list[np.ndarray] = [clips[i % len(clips)] for i in range(size)]
        texts = [r.text for r in engine.transcribe_batch(batch, "en") if r.text]
        if intent is not None and texts:
            intent.classify(texts)
