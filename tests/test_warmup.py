"""streamserver/asr/warmup.py: a GPU worker recognises real speech at each batch size it makes
and labels the texts before it says it is ready (here on the CPU engine, sizes 1 and 2)."""

from __future__ import annotations

from streamserver.asr.warmup import warm_live_path
from streamserver.intent.model import EmbeddingIntentClassifier


class Recording(EmbeddingIntentClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str]] = []

    def classify(self, texts):  # noqa: ANN001, ANN201 - the classifier's own
        self.batches.append(list(texts))
        return super().classify(texts)


def test_the_live_path_is_warmed_at_each_batch_size_with_real_speech(tiny_engine):
    sizes: list[int] = []
    transcribe = tiny_engine.transcribe_batch

    def recorded(audios, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        sizes.append(len(audios))
        return transcribe(audios, *args, **kwargs)

    intent = Recording()
    tiny_engine.transcribe_batch = recorded
    try:
        warm_live_path(tiny_engine, intent, max_batch=2)
    finally:
        del tiny_engine.transcribe_batch
    assert sizes == [1, 2]
    assert [len(b) for b in intent.batches] == [1, 2]
    assert all(len(text.split()) >= 3 for batch in intent.batches for text in batch)  # speech, not noise
