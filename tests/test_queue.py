"""The Redis Streams job queue between gateways and ASR workers, on a real redis-server and the
real tiny.en engine: exactly one transcript per utterance through crashes, claims and restarts."""

from __future__ import annotations

import asyncio
import json
import uuid

import numpy as np
import pytest
import redis

from engines.features import as_float
from streamserver.queue.fair import FairTurns, gives_way
from streamserver.asr.worker import AsrWorker, cancel_for_sure
from streamserver.bus.keys import history_key
from streamserver.events import TranscriptEvent, Utterance, now
from streamserver.queue.jobs import decode_job, encode_job
from streamserver.bus.keys import alive_key
from streamserver.queue.redis_queue import CLAIM_MIN_IDLE_MS, RedisQueue
from tests.redis_server import RedisServer


def utterance(audio: np.ndarray, room: str = "r1", student: str = "s1") -> Utterance:
    t = now()
    return Utterance(uuid.uuid4().hex, room, student, "Ann", "en", audio, t - audio.size / 16000, t)


def history(url: str, room: str) -> list[dict]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return [json.loads(f["event"]) for _id, f in client.xrange(history_key(room))]
    finally:
        client.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def drained(producer: RedisQueue, worker: asyncio.Task, timeout_s: float) -> None:
    """Wait up to timeout_s for the worker to empty the queue, stop it, and check it did."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while await producer.depth() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    await cancel_for_sure(worker)
    assert await producer.depth() == 0


@pytest.fixture()
def fresh(redis_url: str) -> str:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    return redis_url


def test_job_encoding_round_trip():
    audio = (np.sin(np.arange(16000) / 10) * 0.5).astype(np.float32)
    u = utterance(audio)
    back = decode_job({k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in encode_job(u).items()})
    assert (back.utterance_id, back.room_id, back.student_name, back.end_of_speech_ts) == (u.utterance_id, u.room_id, "Ann", u.end_of_speech_ts)
    assert back.audio.dtype == np.int16  # as queued: the engines take PCM16 as it is
    assert np.abs(as_float(back.audio) - audio).max() < 1e-4


def test_fair_share_gives_every_room_a_place():
    waiting = [("loud", i) for i in range(20)] + [("quiet", 0), ("other", 0)]
    batch = FairTurns().batch(waiting, 4, lambda item: (item[0], ""))
    assert sorted(room for room, _ in batch) == ["loud", "loud", "other", "quiet"]
    assert len(waiting) == 18 and all(room == "loud" for room, _ in waiting)


def test_fair_turns_carry_over_batches_of_one_and_share_a_room_by_source():
    """Batches of one (a CPU): a room behind another's backlog waits for one utterance, not the
    backlog; inside a room, a source that floods it takes turns with the room's other sources."""
    turns, share = FairTurns(), lambda item: item[:2]
    waiting = [("A", "flood", i) for i in range(10)]
    assert turns.batch(waiting, 1, share) == [("A", "flood", 0)]
    waiting += [("B", "bob", 0), ("A", "ann", 0), ("A", "flood", 10)]
    taken = [turns.batch(waiting, 1, share)[0] for _ in range(4)]
    assert taken == [("B", "bob", 0), ("A", "ann", 0), ("A", "flood", 1), ("A", "flood", 2)]


def test_the_source_holding_most_of_a_room_gives_way():
    assert gives_way({"flood": 190, "ann": 2}, "ann") == "flood"
    assert gives_way({"flood": 190, "ann": 2}, "bob") == "flood"
    assert gives_way({"school": 200}, "school") is None  # one address (a NAT): refused, as before
    assert gives_way({"a": 100, "b": 100}, "a") is None


def test_duplicate_publication_is_suppressed(fresh):
    async def body() -> None:
        q = RedisQueue(fresh, "w1")
        await q.ensure_group()
        u = utterance(np.zeros(1600, np.float32))
        await q.submit(u)
        [(entry_id, got)] = await q.read(10, 100)
        event = TranscriptEvent.of(got, "hi", "en")
        assert await q.complete(entry_id, got, event) is True
        assert await q.complete(entry_id, got, event) is False  # a second delivery publishes nothing
        assert await q.depth() == 0
        await q.close()

    run(body())
    assert len(history(fresh, "r1")) == 1


def test_jobs_of_a_dead_worker_are_claimed_and_published_once(fresh, tiny_engine, librivox):
    """Worker A takes jobs and dies without a word (no ack, heartbeat stops); worker B claims
    them once A's heartbeat expires and publishes each exactly once."""
    clips = [audio for _name, audio, _text in librivox[:3]]

    async def body() -> None:
        producer = RedisQueue(fresh)
        sent = [utterance(a, room="r1", student=f"s{i}") for i, a in enumerate(clips)]
        dead = RedisQueue(fresh, "dead-worker")
        await dead.ensure_group()
        await dead.heartbeat({"utt_per_s": 1.0})
        for u in sent:
            await producer.submit(u)
        taken = await dead.read(10, 100)  # delivered to A, never acknowledged
        assert len(taken) == 3
        live = RedisQueue(fresh, "live-worker")
        worker = AsrWorker(tiny_engine, live, None, max_batch=8)
        await drained(producer, asyncio.create_task(worker.run()), 20)
        for q in (producer, dead, live):
            await q.close()
        events = [e for e in history(fresh, "r1") if e["type"] == "transcript"]
        assert sorted(e["utterance_id"] for e in events) == sorted(u.utterance_id for u in sent)
        assert all(e["text"] for e in events)

    run(body())


def test_a_worker_whose_connections_closed_is_dead_before_its_heartbeat_expires(fresh):
    """A SIGKILLed worker's sockets are closed by the kernel: its named connections leave Redis's
    client list at once, so its jobs are claimed within a claim round, not after ALIVE_TTL_S."""

    async def body() -> None:
        producer = RedisQueue(fresh)
        dying = RedisQueue(fresh, "dying worker")  # a space: CLIENT SETNAME needs it replaced
        await dying.ensure_group()
        await dying.heartbeat({"utt_per_s": 1.0})
        await producer.submit(utterance(np.zeros(1600, np.float32)))
        assert len(await dying.read(10, 100)) == 1
        live = RedisQueue(fresh, "live-worker")
        await live.heartbeat({"utt_per_s": 1.0})
        assert await live.claim_orphans() == []  # alive and connected: its job stays its own
        await dying.close()  # what the kernel does to a killed process's sockets
        await asyncio.sleep(CLAIM_MIN_IDLE_MS / 1000 + 0.05)
        claimed = await live.claim_orphans()
        assert await producer.redis.exists(alive_key("dying worker"))  # the heartbeat has not expired
        assert len(claimed) == 1
        for q in (producer, live):
            await q.close()

    run(body())


def test_redis_restart_with_aof_loses_nothing(tmp_path, tiny_engine, librivox):
    """Jobs queued before a Redis restart (append-only file) are transcribed after it, and a
    worker that was running through a restart reconnects by itself and takes new jobs."""
    server = RedisServer(persist_dir=tmp_path / "aof").start()
    clips = [audio for _name, audio, _text in librivox[:2]]

    async def wait_for(ids: set[str], room: str) -> None:
        for _ in range(300):
            if {e["utterance_id"] for e in history(server.url, room)} >= ids:
                return
            await asyncio.sleep(0.1)

    async def body() -> None:
        producer = RedisQueue(server.url)
        q = RedisQueue(server.url, "w-restart")
        await q.ensure_group()
        before = [utterance(a, room="r2") for a in clips]
        for u in before:
            await producer.submit(u)
        server.stop()  # SIGTERM: redis writes its AOF out and exits
        server.start()
        worker = AsrWorker(tiny_engine, q, None)
        task = asyncio.create_task(worker.run())
        await wait_for({u.utterance_id for u in before}, "r2")
        server.stop()  # again, under a running worker
        await asyncio.sleep(1.0)
        server.start()
        after = [utterance(clips[0], room="r3")]
        for u in after:
            await producer.submit(u)
        await wait_for({u.utterance_id for u in after}, "r3")
        await cancel_for_sure(task)
        await producer.close()
        await q.close()
        for room, sent in (("r2", before), ("r3", after)):
            ids = [e["utterance_id"] for e in history(server.url, room) if e["type"] == "transcript"]
            assert sorted(ids) == sorted(u.utterance_id for u in sent)

    try:
        run(body())
    finally:
        server.stop()


def test_a_batch_s_finals_are_published_in_one_call(fresh, tiny_engine, librivox):
    """Under load Redis answers each call later: a batch's finals are completed in one call per
    shard (one student's in the order spoken), so that the worker is not held, nor its CPU
    spent, a round trip per final."""
    clips = [audio for _name, audio, _text in librivox[:3]]
    delay_s = 0.3

    class SlowRedis(RedisQueue):  # a real Redis, each call's answer `delay_s` late
        calls: list[int] = []
        singles = 0

        async def complete(self, entry_id, u, event):  # noqa: ANN001, ANN202
            SlowRedis.singles += 1
            return await super().complete(entry_id, u, event)

        async def complete_many(self, done):  # noqa: ANN001, ANN202
            SlowRedis.calls.append(len(done))
            await asyncio.sleep(delay_s)
            return await super().complete_many(done)

    async def body() -> None:
        producer = RedisQueue(fresh)
        first = utterance(clips[0], student="s0")
        sent = [first] + [utterance(clips[i % 3], student=f"s{i}") for i in range(1, 8)] + [utterance(clips[1], student="s0")]
        for u in sent:
            await producer.submit(u)
        q = SlowRedis(fresh, "w1")
        worker = AsrWorker(tiny_engine, q, None, max_batch=16)
        worker.batch_budget_s = 60.0  # the whole queue in one batch, however slow this machine's engine
        await drained(producer, asyncio.create_task(worker.run()), 30)
        await producer.close()
        await q.close()
        events = [e for e in history(fresh, "r1") if e["type"] == "transcript"]
        assert sorted(e["utterance_id"] for e in events) == sorted(u.utterance_id for u in sent)
        of_s0 = [e["utterance_id"] for e in events if e["student_id"] == "s0"]
        assert of_s0 == [sent[0].utterance_id, sent[-1].utterance_id]  # one student's in the order spoken
        # 9 finals of 8 students, one batch: one call, none of complete() one by one
        assert SlowRedis.calls == [len(sent)] and SlowRedis.singles == 0, (SlowRedis.calls, SlowRedis.singles)

    run(body())


def test_a_workers_room_event_reaches_the_rooms_channel_and_history(fresh):
    """A question group a `streamserver worker` sends (RedisQueue.publish_event): on the room's
    channel for its dashboards, and in its history as the room's bus keeps it (not in the class
    transcript: no final)."""
    from streamserver.bus.redis import RedisBus
    from streamserver.events import QuestionGroupEvent

    async def body() -> None:
        bus, queue = RedisBus(fresh), RedisQueue(fresh, "w1")
        try:
            feed = bus.subscribe("r1")
            first = asyncio.ensure_future(feed.__anext__())
            await asyncio.sleep(0.2)  # subscribed
            event = QuestionGroupEvent("r1", "w1.abc:0", "why is the sky blue", 2, 2, now())
            assert await queue.publish_event(event)
            assert json.loads(await asyncio.wait_for(first, 10)) == event.to_dict()
            assert [json.loads(e) for e in await bus.history("r1")] == [event.to_dict()]
            assert await bus.transcript("r1") == []
            await feed.aclose()
        finally:
            await queue.close()
            await bus.close()

    run(body())
