"""One ASR worker for all rooms: a queue, a dynamic batcher, the engine off the event loop.

Batching policy: whatever is queued when the engine becomes free goes in the next batch (up to
max_batch, grouped by language). Nothing waits for a batch to fill: under light load an
utterance is transcribed alone at once; under load, batches grow by themselves while the
engine is busy.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

import numpy as np

from engines.engine import Engine, Transcript
from streamserver.events import TranscriptEvent, Utterance
from streamserver.intent import IntentClassifier

log = logging.getLogger(__name__)
Publish = Callable[[TranscriptEvent], Awaitable[None]]


class AsrWorker:
    def __init__(self, engine: Engine, publish: Publish, max_batch: int = 16, intent: IntentClassifier | None = None) -> None:
        self.engine = engine
        self.intent = intent
        self.publish = publish
        self.max_batch = max_batch
        self.queue: asyncio.Queue[Utterance] = asyncio.Queue()
        # One thread: the engine serves one batch at a time; the event loop never waits on it.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asr")
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.transcribed = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="asr-worker")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def submit(self, utterance: Utterance) -> None:
        self.queue.put_nowait(utterance)

    async def _run(self) -> None:
        while True:
            batch = [await self.queue.get()]
            while len(batch) < self.max_batch and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            try:
                await self._transcribe(batch)
            except Exception:  # one bad batch must not stop transcription for every room
                log.exception("ASR batch of %d failed", len(batch))

    async def _transcribe(self, batch: list[Utterance]) -> None:
        by_language: dict[str, list[Utterance]] = defaultdict(list)
        for u in batch:
            by_language[u.language].append(u)
        loop = asyncio.get_running_loop()
        for language, group in by_language.items():
            audios = [u.audio for u in group]
            results, intents = await loop.run_in_executor(
                self._executor, recognise, self.engine, self.intent, audios, None if language == "auto" else language
            )
            self.batches += 1
            for u, r in zip(group, results):
                self.transcribed += 1
                if not r.text:
                    continue  # non-speech: nothing to show the teacher
                event = TranscriptEvent.of(u, r.text, r.language)
                event.intent = intents.get(r.text)
                await self.publish(event)


def recognise(
    engine: Engine, intent: IntentClassifier | None, audios: list[np.ndarray], language: str | None
) -> tuple[list[Transcript], dict[str, dict]]:
    """In a worker thread: transcripts, then the intent of each distinct non-empty one."""
    results = engine.transcribe_batch(audios, language)
    texts = sorted({r.text for r in results if r.text})
    intents: dict[str, dict] = {}
    if intent and texts:
        try:
            intents = {t: i.to_dict() for t, i in zip(texts, intent.classify(texts))}
        except Exception:  # a transcript without a label beats no transcript
            log.exception("intent classification failed")
    return results, intents
