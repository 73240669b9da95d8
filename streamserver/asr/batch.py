"""One batch of utterances -> one event each: grouped by language, recognised in a worker
thread (the event loop never waits on the engine), labelled with their intent.

A group whose engine call raises is retried one utterance at a time, so one bad utterance
costs only itself; an utterance that fails alone comes back without an event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from engines.engine import Engine, Transcript, looks_looped
from streamserver.events import NoSpeechEvent, TranscriptEvent, Utterance
from streamserver.intent import IntentClassifier
from streamserver.metrics import Metrics
from streamserver.queue.base import Entry

log = logging.getLogger(__name__)
Result = tuple[Entry, TranscriptEvent | None]  # None: recognition of this utterance failed
Recognised = tuple[Entry, Transcript | None]  # the engine's result, before its event is made
VECTORS_KEPT = 4096  # texts whose embedding is kept for their question's group (vector_of)


def result_event(u: Utterance, r: Transcript, intents: dict[str, dict]) -> TranscriptEvent:
    if not r.text:
        return NoSpeechEvent.of(u, language=r.language)
    return TranscriptEvent.of(u, r.text, r.language, intents.get(r.text))


class BatchRecogniser:
    """The engine, then the intent labels, each timed (streamserver_recognition_seconds_total):
    on a GPU worker the labels can cost more time than the engine (benchmarks/README.md,
    "Intent labels on the GPU")."""

    def __init__(self, engine: Engine, intent: IntentClassifier | None, metrics: Metrics,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.engine, self.intent, self.metrics = engine, intent, metrics
        # One thread: the engine serves one batch at a time.
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="asr")
        self.last_seconds: dict[str, float] = {}  # the last run()'s time by part: engine, intent
        # The labeller's e5 embedding of the texts it labelled last (a classifier with
        # classify_embedded: model.EmbeddingIntentClassifier), the newest VECTORS_KEPT: a question's
        # group is found from it (intent/groups.py), also for a final published from its
        # speculation's result later, without embedding the text again.
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()

    def _spent(self, part: str, started: float) -> None:
        """In the worker thread: `part`'s time since `started`, counted and kept for run()'s caller."""
        seconds = time.perf_counter() - started
        self.metrics.recognition_seconds.labels(part=part).inc(seconds)
        self.last_seconds[part] = self.last_seconds.get(part, 0.0) + seconds

    def uncounted(self) -> BatchRecogniser:
        """This recogniser on its own thread, its time not counted as work (a warm-up): a GPU
        library's state is per thread (cuBLAS handles, workspaces), so a warm-up in any other
        thread leaves the first real batch to pay for it (1 s of labels on a fresh H200)."""
        return BatchRecogniser(self.engine, self.intent, Metrics(), self._executor)

    async def warm_labels(self, rows: int, words: int) -> None:
        """Labels for `rows` texts of about `words` words, in this recogniser's thread (a warm-up
        of the shapes real texts bring)."""
        if self.intent is not None:
            texts = [" ".join(["question"] * words) + f" {i}" for i in range(rows)]
            await asyncio.get_running_loop().run_in_executor(self._executor, self._intents, texts)

    async def vector_of(self, text: str) -> np.ndarray | None:
        """The text's e5 embedding as its label read it; embedded now (in this recogniser's
        thread) only for a text labelled elsewhere (another worker's speculation). None without
        an embedding classifier."""
        vector = self._vectors.get(text)
        if vector is None and hasattr(self.intent, "classify_embedded"):
            await asyncio.get_running_loop().run_in_executor(self._executor, self._intents, [text])
            vector = self._vectors.get(text)
        return vector

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, batch: list[Entry]) -> list[Result]:
        """Partials (live captions) get no intent label: only finals and speculations do."""
        self.last_seconds = {}
        return await self._label(await self._recognise(batch))

    async def _recognise(self, batch: list[Entry]) -> list[Recognised]:
        """The engine's results, grouped by language, and partials apart where the engine has a
        cheaper window for captions (one engine call per group)."""
        groups: dict[tuple[str, bool], list[Entry]] = defaultdict(list)
        for entry in batch:
            caption = self.engine.caption_policy is not None and entry[1].kind == "partial"
            groups[(entry[1].language, caption)].append(entry)
        out: list[Recognised] = []
        for (language, caption), group in groups.items():
            out += await self._group(group, None if language == "auto" else language, caption)
        return out

    async def _label(self, recognised: list[Recognised]) -> list[Result]:
        """Each result's event, with the intent of each distinct non-empty text of a final or
        speculation."""
        texts = sorted({r.text for entry, r in recognised if r is not None and r.text and entry[1].kind != "partial"})
        intents: dict[str, dict] = {}
        if self.intent is not None and texts:
            intents = await asyncio.get_running_loop().run_in_executor(self._executor, self._intents, texts)
        return [(entry, None if r is None else result_event(entry[1], r, intents)) for entry, r in recognised]

    def _intents(self, texts: list[str]) -> dict[str, dict]:
        """In the worker thread."""
        assert self.intent is not None
        started = time.perf_counter()
        try:
            if not hasattr(self.intent, "classify_embedded"):
                return {t: i.to_dict() for t, i in zip(texts, self.intent.classify(texts))}
            intents, vectors = self.intent.classify_embedded(texts)
            for text, vector in zip(texts, vectors):
                self._vectors[text] = vector
                self._vectors.move_to_end(text)
            while len(self._vectors) > VECTORS_KEPT:
                self._vectors.popitem(last=False)
            return {t: i.to_dict() for t, i in zip(texts, intents)}
        except Exception:  # a transcript without a label beats no transcript
            log.exception("intent classification failed")
            return {}
        finally:
            self._spent("intent", started)

    def _transcribe(self, audios: list[np.ndarray], language: str | None, caption: bool) -> list[Transcript]:
        """In the worker thread."""
        started = time.perf_counter()
        try:
            if caption:
                # A caption is never worth a second engine run: one that loops at the short window
                # (tiny.en on "Could you explain the second step of the proof again?" at 3 s) would
                # be re-run at 30 s, 3-5x the caption's cost, while finals wait behind it. It is
                # shown as nothing instead; the caption before it stays and the final follows.
                results = self.engine.transcribe_batch(audios, language, fallback=False, window=self.engine.caption_policy)
                return [replace(r, text="", rejected=r.rejected or "repetition") if looks_looped(r) else r for r in results]
            return self.engine.transcribe_batch(audios, language)
        finally:
            self._spent("engine", started)

    async def _group(self, group: list[Entry], language: str | None, caption: bool = False) -> list[Recognised]:
        audios = [u.audio for _, u in group]
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self._transcribe, audios, language, caption)
        except Exception:  # noqa: BLE001 - whatever the engine raised, the others still get theirs
            if len(group) == 1:
                log.exception("recognition of utterance %s failed", group[0][1].utterance_id)
                return [(group[0], None)]
            log.exception("recognition of a batch of %d failed; retrying its utterances one by one", len(group))
            return [result for entry in group for result in await self._group([entry], language, caption)]
        self.metrics.batch_size.observe(len(group))
        return list(zip(group, results))
