"""One pipeline for serve and gateway: serve's in-process queue and worker keep the gateway +
worker promises (per-utterance retry, per-room fair share, the same events and /metrics), on the
real tiny.en engine and real speech."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import numpy as np
from aiohttp.test_utils import TestServer

from streamserver.asr.worker import AsrWorker
from streamserver.asr.worker_process import metrics_app
from streamserver.bus.memory import MemoryBus
from streamserver.bus.ordered import OrderedPublisher
from streamserver.config import Settings
from streamserver.events import Utterance, now
from streamserver.metrics import Metrics
from streamserver.queue.memory_queue import MemoryQueue
from streamserver.queue.redis_queue import RedisQueue
from streamserver.server import serve_app


def utterance(audio: np.ndarray, room: str, student: str = "s1") -> Utterance:
    t = now()
    return Utterance(uuid.uuid4().hex, room, student, "Ann", "en", audio, t - audio.size / 16000, t)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 180))


@contextlib.asynccontextmanager
async def collected(bus: MemoryBus, *rooms: str) -> AsyncIterator[list[dict]]:
    """Every event published to the rooms, in order of arrival."""
    events: list[dict] = []

    async def listen(room: str) -> None:
        async for event in bus.subscribe(room):
            events.append(json.loads(event))

    tasks = [asyncio.create_task(listen(r)) for r in rooms]
    await asyncio.sleep(0)
    try:
        yield events
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until(condition, timeout: float = 120) -> None:  # noqa: ANN001 - a callable
    for _ in range(int(timeout * 20)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


def test_a_failing_batch_is_retried_one_utterance_at_a_time(tiny_engine, librivox):
    """An empty utterance makes the real engine raise for the whole batch; the speech beside it
    is still transcribed, and the bad one is delivered again until it is given up with an event."""
    speech = librivox[0][1]

    async def body() -> None:
        bus = MemoryBus()
        queue = MemoryQueue(OrderedPublisher(bus), visibility_s=0.3)
        worker = AsrWorker(tiny_engine, queue, None, max_batch=8)
        async with collected(bus, "r1") as events:
            good, bad = utterance(speech, "r1"), utterance(np.zeros(0, np.float32), "r1", "s2")
            await queue.submit(good)
            await queue.submit(bad)
            worker.start()
            await until(lambda: len(events) == 2)
            await worker.stop()
        transcript, failed = events
        assert transcript["type"] == "transcript" and transcript["utterance_id"] == good.utterance_id
        assert len(transcript["text"].split()) >= 5
        assert failed["type"] == "utterance_failed" and failed["utterance_id"] == bad.utterance_id
        assert await queue.depth() == 0

    run(body())


def test_the_worker_groups_a_rooms_questions_and_sends_each_group_as_it_grows(tiny_engine):
    """Real speech (flite's classroom clips) through the real worker, tiny.en and intent labeller:
    the same question from two students is one group of two, the help request another group,
    the answer none; each group sent to the room as it grew, its id the worker's."""
    from engines.audio import load_audio
    from streamserver.intent.model import EmbeddingIntentClassifier

    flite = Path(__file__).parent / "data" / "flite"
    question, answer, help_request = (load_audio(flite / f"flite_{i}.wav") for i in (1, 2, 3))

    async def body() -> None:
        bus = MemoryBus()
        queue = MemoryQueue(OrderedPublisher(bus))
        worker = AsrWorker(tiny_engine, queue, EmbeddingIntentClassifier(), max_batch=1, partials="off")
        spoken = [utterance(question, "r1", "s1"), utterance(answer, "r1", "s2"), utterance(help_request, "r1", "s3"),
                  utterance(question, "r1", "s4")]
        async with collected(bus, "r1") as events:
            for u in spoken:
                await queue.submit(u)
            worker.start()
            await until(lambda: sum(e["type"] == "transcript" for e in events) == 4
                        and sum(e["type"] == "question_group" for e in events) == 3)
            await worker.stop()
        labels = {e["utterance_id"]: e["intent"]["label"] for e in events if e["type"] == "transcript"}
        assert [labels[u.utterance_id] for u in spoken] == ["help_request", "answer", "help_request", "help_request"]
        asked, microphone, again = [e for e in events if e["type"] == "question_group"]
        assert asked["group_id"] == again["group_id"] != microphone["group_id"]
        assert asked["group_id"].startswith(f"{worker.groups_id}:") and asked["room_id"] == "r1"
        assert (asked["count"], asked["students"], again["count"], again["students"]) == (1, 1, 2, 2)
        assert "proof" in again["question"] and "microphone" in microphone["question"]
        assert microphone["count"] == 1 and not again["answered"]

    run(body())


def test_serve_gives_each_room_a_fair_share(tiny_engine, librivox):
    """A room with 40 utterances queued does not hold back another room's one: from the moment
    it is queued, at most the batch already running and the next one (its own) go first."""
    clip = librivox[1][1][: 16000 * 2]
    batch = 4

    async def body() -> list[dict]:
        app, classroom = serve_app(Settings(max_batch=batch), tiny_engine, None)
        async with collected(classroom.bus, "loud", "quiet") as events:
            for i in range(40):
                classroom.sink.submit(utterance(clip, "loud", f"s{i}"))
            await classroom.start()
            await until(lambda: any(e["type"] == "transcript" for e in events))
            classroom.sink.submit(utterance(clip, "quiet"))
            await until(lambda: any(e["type"] == "transcript" and e["room_id"] == "quiet" for e in events))
            await classroom.stop()
        return events

    events = run(body())
    queued, transcript = [e for e in events if e["room_id"] == "quiet"]
    assert (queued["type"], transcript["type"]) == ("utterance_queued", "transcript")
    # By the server's own stamps, not by arrival: the two rooms' listeners are separate tasks.
    ahead = [e for e in events if e["type"] == "transcript" and e["room_id"] == "loud"
             and queued["ts"] <= e["published_ts"] <= transcript["published_ts"]]
    assert len(ahead) <= 2 * batch - 1, len(ahead)
    assert sum(e["type"] == "transcript" for e in events) < 40  # the backlog was still there


def _families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def _sample(text: str, name: str) -> float:
    [line] = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def test_serve_metrics_are_the_workers(tiny_engine, librivox, redis_url):
    """serve's /metrics has the worker's end-of-speech -> published and batch-size histograms (and
    every other family a worker exposes), filled by its in-process worker."""

    async def body() -> None:
        app, classroom = serve_app(Settings(admin_token="metrics-test"), tiny_engine, None)
        served = TestServer(app, host="127.0.0.1")
        await served.start_server()
        worker_server = TestServer(metrics_app(AsrWorker(tiny_engine, RedisQueue(redis_url, "metrics-test"), None, 4, Metrics())),
                                   host="127.0.0.1")
        await worker_server.start_server()
        try:
            async with collected(classroom.bus, "r1") as events:
                classroom.sink.submit(utterance(librivox[0][1], "r1"))
                await until(lambda: any(e["type"] == "transcript" for e in events))
            async with aiohttp.ClientSession() as s:
                serve_text = await (await s.get(f"http://127.0.0.1:{served.port}/metrics",
                                                headers={"Authorization": "Bearer metrics-test"})).text()
                worker_text = await (await s.get(f"http://127.0.0.1:{worker_server.port}/metrics")).text()
        finally:
            await served.close()
            await worker_server.close()
        assert _families(worker_text) <= _families(serve_text)
        assert {"streamserver_eos_to_published_seconds", "streamserver_batch_size", "process_resident_memory_bytes"} <= _families(serve_text)
        assert _sample(serve_text, "streamserver_eos_to_published_seconds_count") == 1.0
        assert _sample(serve_text, "streamserver_batch_size_count") == 1.0
        assert [e["type"] for e in events] == ["utterance_queued", "transcript"]  # the gateway's events

    run(body())
