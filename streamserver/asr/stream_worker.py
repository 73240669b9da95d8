"""An ASR worker process's loop: jobs from the Redis Stream -> fair batches -> engine -> rooms.

Reads new jobs (and claims those of dead workers) into a small local buffer, takes a batch by
per-room fair share, transcribes it in a worker thread, then publishes and acknowledges each job
in one atomic step (JobQueue.complete). Redis going away pauses the loop, which retries with
backoff; a finished result whose publication failed is retried, never dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from redis.exceptions import RedisError

from engines.engine import ENGINE_LOADS, Engine
from streamserver.asr.fair import fair_batch
from streamserver.asr.worker import recognise
from streamserver.events import TranscriptEvent, Utterance
from streamserver.intent import IntentClassifier
from streamserver.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, Counter, Gauge, Histogram, Registry, gpu_memory
from streamserver.queue.redis_queue import MAX_ATTEMPTS, Entry, JobQueue

log = logging.getLogger(__name__)
_REDIS_DOWN = (RedisError, OSError)
HEARTBEAT_S = 0.25  # also how often dead workers' jobs are looked for


def worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class StreamWorker:
    def __init__(self, engine: Engine, queue: JobQueue, intent: IntentClassifier | None = None, max_batch: int = 16) -> None:
        self.engine, self.queue, self.intent, self.max_batch = engine, queue, intent, max_batch
        self.buffer: list[Entry] = []
        self._in_progress: set[str] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asr")
        self._rate = 0.0  # utterances/s, smoothed: what backpressure reads
        self.ready = False  # engine loaded and Redis reachable: /readyz
        self.metrics = Registry()
        m = self.metrics
        self.m_batches = m.add(Histogram("streamserver_batch_size", "utterances per engine batch", BATCH_BUCKETS))
        self.m_latency = m.add(Histogram("streamserver_eos_to_published_seconds", "end of speech to published", LATENCY_BUCKETS))
        self.m_done = m.add(Counter("streamserver_utterances_total", "utterances finished, by outcome"))
        self.m_depth = m.add(Gauge("streamserver_queue_depth", "jobs in the stream not yet published"))
        m.add(Gauge("streamserver_engine_loads_total", "engine loads by backend and outcome",
                    read=lambda: {(("backend", b), ("outcome", o)): float(n) for (b, o), n in ENGINE_LOADS.items()}))
        m.add(Gauge("streamserver_gpu_memory_bytes", "GPU memory held by the engine", read=gpu_memory))

    async def run(self) -> None:
        await self._until_redis(self.queue.ensure_group)
        self.ready = True
        tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._claims())]
        try:
            await self._loop()
        finally:
            for t in tasks:
                t.cancel()
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _until_redis(self, op, *args):  # noqa: ANN001, ANN202 - any queue coroutine
        delay = 0.1
        while True:
            try:
                return await op(*args)
            except _REDIS_DOWN as error:
                self.ready = False
                log.warning("redis unavailable (%s); retrying in %.1fs", error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _heartbeats(self) -> None:
        while True:
            try:
                await self.queue.heartbeat({"utt_per_s": round(self._rate, 2), "buffer": len(self.buffer)})
                self.m_depth.set(await self.queue.depth())
                self.ready = True
            except _REDIS_DOWN:
                self.ready = False
            await asyncio.sleep(HEARTBEAT_S)

    async def _claims(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                claimed = await self.queue.claim_orphans()
            except _REDIS_DOWN:
                continue
            known = {eid for eid, _ in self.buffer} | self._in_progress
            self.buffer += [e for e in claimed if e[0] not in known]

    async def _loop(self) -> None:
        while True:
            if not self.buffer:
                # No read-ahead: jobs this worker holds but has not started are the ones that
                # wait for a claim if it dies, so it takes only what its next batch will use.
                try:
                    self.buffer += await self.queue.read(self.max_batch, 200)
                except _REDIS_DOWN as error:
                    self.ready = False
                    log.warning("redis unavailable (%s)", error)
                    await asyncio.sleep(0.5)
                    continue
            if not self.buffer:
                continue
            batch = fair_batch(self.buffer, self.max_batch, lambda e: e[1].room_id)
            self._in_progress = {eid for eid, _ in batch}  # not to be claimed back from ourselves
            await self._transcribe(batch)

    async def _transcribe(self, batch: list[Entry]) -> None:
        started = time.perf_counter()
        by_language: dict[str, list[Entry]] = defaultdict(list)
        for entry in batch:
            by_language[entry[1].language].append(entry)
        loop = asyncio.get_running_loop()
        for language, group in by_language.items():
            audios = [u.audio for _, u in group]
            try:
                results, intents = await loop.run_in_executor(
                    self._executor, recognise, self.engine, self.intent, audios, None if language == "auto" else language
                )
            except Exception:  # noqa: BLE001 - the job stays pending; retried up to MAX_ATTEMPTS
                if len(group) > 1:  # one bad utterance must not fail the others: each alone
                    log.exception("ASR batch of %d failed; retrying its utterances one by one", len(group))
                    for entry in group:
                        await self._transcribe([entry])
                    continue
                log.exception("ASR of utterance %s failed", group[0][1].utterance_id)
                await self._failed(group)
                continue
            self.m_batches.observe(len(group))
            for (entry_id, u), r in zip(group, results):
                event = TranscriptEvent.of(u, r.text, r.language)
                if r.text:
                    event.intent = intents.get(r.text)
                else:
                    event.type = "no_speech"  # accounted for, not shown: the utterance had no words
                await self._complete(entry_id, u, event)
        seconds = time.perf_counter() - started
        self._rate = 0.8 * self._rate + 0.2 * (len(batch) / max(seconds, 1e-3))

    async def _complete(self, entry_id: str, u: Utterance, event: TranscriptEvent) -> None:
        fresh = await self._until_redis(self.queue.complete, entry_id, u, event.to_json())
        if fresh:
            self.m_done.inc(outcome=event.type)
            self.m_latency.observe(max(0.0, event.published_ts - u.end_of_speech_ts))
        else:
            self.m_done.inc(outcome="duplicate_suppressed")

    async def _failed(self, group: list[Entry]) -> None:
        for entry_id, u in group:
            if await self._until_redis(self.queue.attempt, entry_id) >= MAX_ATTEMPTS:
                log.error("giving up utterance %s after %d attempts", u.utterance_id, MAX_ATTEMPTS)
                event = TranscriptEvent.of(u, "", u.language)
                event.type = "utterance_failed"
                await self._complete(entry_id, u, event)
