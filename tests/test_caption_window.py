"""Live captions on a CPU are recognised at a shorter encoder window than finals (policy.py's
CAPTION_WINDOWS): cheaper, still close to the final's words; finals and speculations keep the
final's window, and a GPU (cheap rows) has no caption window at all."""

from __future__ import annotations

import asyncio

import numpy as np

from benchmarks.scoring import wer
from engines.loading import load_engine
from engines.policy import POLICIES, caption_policy
from streamserver.asr.batch import BatchRecogniser
from streamserver.events import Utterance, now
from streamserver.metrics import Metrics


class WindowSpy:
    """The real engine, noting the window each call asked for."""

    batch_rows_cheap = False

    def __init__(self, engine) -> None:  # noqa: ANN001 - an Engine
        self.engine, self.caption_policy, self.windows = engine, engine.caption_policy, []

    def transcribe_batch(self, audios, language=None, prompt=None, fallback=True, window=None):  # noqa: ANN001, ANN201
        self.windows.append((len(audios), window.name if window else None))
        return self.engine.transcribe_batch(audios, language, prompt, fallback, window)


def test_tiny_en_captions_at_a_shorter_window_on_a_cpu(tiny_engine):
    assert tiny_engine.policy.name == "pad30-zero"
    assert tiny_engine.caption_policy is POLICIES["min10s-zero"]
    # a final's own choice of a window shorter than the caption one is kept for captions too
    assert load_engine("tiny.en", threads=2, policy="exact+1s-zero").caption_policy is None
    assert caption_policy("base") is None  # not measured for captions: its final's window


def test_partials_go_apart_at_the_caption_window_and_stay_close_to_the_final(tiny_engine, librivox):
    spy = WindowSpy(tiny_engine)
    recogniser = BatchRecogniser(spy, None, Metrics())
    (_, clip, reference), (_, other, _) = librivox[1], librivox[4]

    def entry(kind: str, audio: np.ndarray, n: int) -> tuple[str, Utterance]:
        return (f"{n}-0", Utterance(f"u{n}", "r", f"s{n}", "Ann", "en", audio, now() - 3, now(), kind=kind))

    batch = [entry("final", other, 1), entry("partial", clip, 2), entry("speculative", clip, 3)]
    results = asyncio.run(recogniser.run(batch))
    recogniser.close()
    assert sorted(spy.windows) == sorted([(2, None), (1, "min10s-zero")])  # finals + speculation apart from the partial
    assert set(recogniser.last_seconds) == {"engine"} and recogniser.last_seconds["engine"] > 0  # no labeller here
    texts = {e[1].kind: ev.text for e, ev in results}
    assert wer([reference], [texts["partial"]]) <= wer([reference], [texts["speculative"]]) + 0.2
    assert texts["speculative"] and texts["partial"]


class LoopingCaptions:
    """An engine whose captions come back as one phrase said twice: what tiny.en gives for the
    first 3 s of "Could you explain the second step of the proof again?" at min10s-zero."""

    batch_rows_cheap = False
    caption_policy = POLICIES["min10s-zero"]

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, bool]] = []

    def transcribe_batch(self, audios, language=None, prompt=None, fallback=True, window=None):  # noqa: ANN001, ANN201
        from engines.engine import Transcript

        self.calls.append((window.name if window else None, fallback))
        text = "Could you explain the second step? Could you explain the second step?" if window else "Could you explain?"
        return [Transcript(text, "en", 0.0, -0.2, 1.5, 1000) for _ in audios]


def test_a_looping_caption_costs_one_run_and_shows_nothing():
    engine = LoopingCaptions()
    recogniser = BatchRecogniser(engine, None, Metrics())
    audio = np.zeros(16000 * 3, np.float32)
    batch = [(f"{n}-0", Utterance(f"u{n}", "r", f"s{n}", "Ann", "en", audio, now() - 3, now(), kind=kind))
             for n, kind in ((1, "partial"), (2, "final"))]
    results = asyncio.run(recogniser.run(batch))
    recogniser.close()
    assert ("min10s-zero", False) in engine.calls  # no 30 s re-run for a caption
    assert (None, True) in engine.calls  # a final keeps its fallback
    texts = {e[1].kind: ev.text for e, ev in results}
    assert texts == {"partial": "", "final": "Could you explain?"}
