"""One batch of utterances -> one event each: grouped by language, recognised in a worker
thread (the event loop never waits on the engine), labelled with their intent.

A group whose engine call raises is retried one utterance at a time, so one bad utterance
costs only itself; an utterance that fails alone comes back without an event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engines.engine import Engine, Transcript
from streamserver.events import NoSpeechEvent, TranscriptEvent, Utterance
from streamserver.intent import IntentClassifier
from streamserver.metrics import Metrics
from streamserver.queue.base import Entry

log = logging.getLogger(__name__)
Result = tuple[Entry, TranscriptEvent | None]  # None: recognition of this utterance failed


def recognise(
    engine: Engine, intent: IntentClassifier | None, audios: list[np.ndarray], language: str | None,
    metrics: Metrics | None = None,
) -> tuple[list[Transcript], dict[str, dict]]:
    """In a worker thread: transcripts, then the intent of each distinct non-empty one."""
    started = time.perf_counter()
    results = engine.transcribe_batch(audios, language)
    labelled = time.perf_counter()
    texts = sorted({r.text for r in results if r.text})
    intents: dict[str, dict] = {}
    if intent and texts:
        try:
            intents = {t: i.to_dict() for t, i in zip(texts, intent.classify(texts))}
        except Exception:  # a transcript without a label beats no transcript
            log.exception("intent classification failed")
    if metrics is not None:
        metrics.recognition_seconds.labels(part="engine").inc(labelled - started)
        metrics.recognition_seconds.labels(part="intent").inc(time.perf_counter() - labelled)
    return results, intents


def result_event(u: Utterance, r: Transcript, intents: dict[str, dict]) -> TranscriptEvent:
    if not r.text:
        return NoSpeechEvent.of(u, language=r.language)
    return TranscriptEvent.of(u, r.text, r.language, intents.get(r.text))


class BatchRecogniser:
    def __init__(self, engine: Engine, intent: IntentClassifier | None, metrics: Metrics) -> None:
        self.engine, self.intent, self.metrics = engine, intent, metrics
        # One thread: the engine serves one batch at a time.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asr")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, batch: list[Entry], with_intent: bool = True) -> list[Result]:
        """`with_intent` False: no intent labels (live captions have none)."""
        by_language: dict[str, list[Entry]] = defaultdict(list)
        for entry in batch:
            by_language[entry[1].language].append(entry)
        out: list[Result] = []
        for language, group in by_language.items():
            out += await self._group(group, None if language == "auto" else language, self.intent if with_intent else None)
        return out

    async def _group(self, group: list[Entry], language: str | None, intent: IntentClassifier | None) -> list[Result]:
        audios = [u.audio for _, u in group]
        loop = asyncio.get_running_loop()
        try:
            results, intents = await loop.run_in_executor(self._executor, recognise, self.engine, intent, audios, language,
                                                          self.metrics)
        except Exception:  # noqa: BLE001 - whatever the engine raised, the others still get theirs
            if len(group) == 1:
                log.exception("recognition of utterance %s failed", group[0][1].utterance_id)
                return [(group[0], None)]
            log.exception("recognition of a batch of %d failed; retrying its utterances one by one", len(group))
            return [result for entry in group for result in await self._group([entry], language, intent)]
        self.metrics.batch_size.observe(len(group))
        return [(entry, result_event(entry[1], r, intents)) for entry, r in zip(group, results)]
