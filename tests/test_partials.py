"""Live captions and speculative finals (issue 15): the segmenter's hints, both queues' hint
rules (newest only, speculative first, never after the final), and the whole path on the real
tiny.en engine and real speech, in-process and through a real Redis."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace

import numpy as np
import redis

from engines.features import as_float
from streamserver.asr.worker import AsrWorker
from streamserver.audio.pipeline import StudentAudio
from streamserver.audio.segmenter import SegmentedSpeech, SegmenterConfig, UtteranceSegmenter
from streamserver.bus.keys import hint_audio_key
from streamserver.bus.memory import MemoryBus
from streamserver.bus.ordered import OrderedPublisher
from streamserver.bus.redis import RedisBus
from streamserver.events import TranscriptEvent, TranscriptPartialEvent, Utterance, audio_digest, now
from streamserver.metrics import Metrics
from streamserver.queue.base import Speculation
from streamserver.queue.jobs import pcm16
from streamserver.queue.memory_queue import MemoryQueue
from streamserver.queue.redis_queue import RedisQueue
from streamserver.queue.sink import UtteranceSink
from tests.redis_server import RedisServer
from tests.test_pipeline import collected, run, until
from tests.takers import SpeechList

RATE = 16000
PAUSE = np.zeros(RATE, np.float32)  # 1 s of silence
PREFIX = uuid.uuid4().hex[:8]  # utterance ids of this run (the Redis server is the session's)


def segment(audio: np.ndarray, config: SegmenterConfig) -> tuple[list[SegmentedSpeech], list[SegmentedSpeech]]:
    finals = SpeechList()
    seg = UtteranceSegmenter(config, finals)
    for i in range(0, audio.size, 320):  # 20 ms packets
        seg.feed(audio[i : i + 320])
    seg.flush()
    return list(finals), finals.hints


def long_clip(librivox) -> np.ndarray:
    return max((a for _, a, _ in librivox), key=lambda a: a.size)


def test_partials_count_up_and_the_speculation_is_the_final(librivox):
    """A 7 s clip: the first partial after half a second of voiced audio, then one per second,
    revisions 1, 2, ..., each the speech so far, all with the final's key; the speculative hint
    holds exactly the final's samples."""
    clip = long_clip(librivox)
    finals, hints = segment(np.concatenate([PAUSE, clip, PAUSE]), SegmenterConfig(partial_interval_ms=1000))
    assert len(finals) == 1
    final = finals[0]
    partials = [h for h in hints if h.kind == "partial"]
    speculative = [h for h in hints if h.kind == "speculative"]
    assert len(partials) >= 4, len(partials)
    revisions = [h.revision for h in hints]  # a speculation counts as one too: its text may be the newest caption
    assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions) and revisions[0] == 1
    assert {h.key for h in hints} == {final.key}
    sizes = [p.audio.size for p in partials]
    assert sizes == sorted(sizes) and sizes[-1] < final.audio.size
    assert sizes[0] < 1.3 * RATE  # 300 ms pre-roll + about half a second of speech
    assert all(np.array_equal(p.audio, final.audio[: p.audio.size]) for p in partials)
    # the last speculation is the one that the hangover confirmed
    assert np.array_equal(speculative[-1].audio, final.audio)
    assert audio_digest(speculative[-1].audio) == audio_digest(final.audio)


def test_a_speculation_on_a_pause_that_was_not_the_end_differs_from_the_final(librivox):
    """Speech that resumes after 400 ms: the speculation made in that pause is shorter than the
    final, so its digest serves no final."""
    clip = librivox[1][1]
    loud = np.flatnonzero(np.abs(clip) > 0.05)
    clip = clip[loud[0] : loud[-1]]  # no quiet edges: the pause is the gap only
    gap = np.zeros(int(0.4 * RATE), np.float32)
    finals, hints = segment(np.concatenate([PAUSE, clip, gap, clip, PAUSE]), SegmenterConfig())
    assert len(finals) == 1
    speculative = [h for h in hints if h.kind == "speculative"]
    assert len(speculative) >= 2
    first = speculative[0]
    assert first.audio.size < finals[0].audio.size
    assert audio_digest(first.audio) != audio_digest(finals[0].audio)
    assert not any(h.kind == "partial" for h in hints)  # partial_interval_ms=0: none


def test_no_speculation_when_the_post_roll_fills_the_hangover(librivox):
    finals, hints = segment(np.concatenate([PAUSE, librivox[0][1], PAUSE]), SegmenterConfig(hangover_ms=250, post_roll_ms=250))
    assert len(finals) == 1 and hints == []


def hint(uid: str, kind: str, revision: int = 0, seconds: float = 1.0, room: str = "hints") -> Utterance:
    audio = np.full(int(seconds * RATE), 0.01 * (revision + 1), np.float32)
    return Utterance(PREFIX + uid, room, "s-" + uid, "Ann", "en", audio, now() - seconds, now(), kind=kind, revision=revision,
                     digest=audio_digest(audio) if kind == "speculative" else "")


async def hint_rules(queue, publisher_bus) -> None:  # noqa: ANN001 - either queue, its bus
    await queue.offer(hint("a", "partial", 1))
    await queue.offer(hint("b", "partial", 1))
    await queue.offer(hint("a", "partial", 2))  # replaces a's first, keeps a's place
    await queue.offer(hint("c", "speculative"))
    assert [h.utterance_id for h in await queue.take_hints(10, partials=False)] == [PREFIX + "c"]
    taken = await queue.take_hints(10)
    assert [(h.utterance_id, h.revision) for h in taken] == [(PREFIX + "a", 2), (PREFIX + "b", 1)]
    assert await queue.take_hints(10) == []
    # a student who has just begun to speak gets a first caption before a captioned one its next
    await queue.offer(hint("a", "partial", 3))
    await queue.offer(hint("e", "partial", 1))
    assert [h.utterance_id for h in await queue.take_hints(1)] == [PREFIX + "e"]
    assert [(h.utterance_id, h.revision) for h in await queue.take_hints(10)] == [(PREFIX + "a", 3)]
    # the final makes its hint pointless; a published utterance takes no more
    await queue.offer(hint("d", "partial", 1))
    final = hint("d", "final")
    await queue.submit(final)
    assert await queue.take_hints(10) == []
    speculation = Speculation(final.digest or "x", TranscriptEvent.of(final, "hello", "en").to_json())
    await queue.keep_speculations({final.utterance_id: speculation})
    assert (await queue.speculations([final.utterance_id, "zz"])).keys() == {final.utterance_id}
    assert (await queue.speculation(final.utterance_id)).event_json == speculation.event_json
    async with collected(publisher_bus, "hints") as events:
        await asyncio.sleep(0.2)  # a Redis subscription is live once acknowledged
        assert await queue.publish_partial(TranscriptPartialEvent.of(hint("d", "partial", 3), "hel", "en"))
        assert await queue.claim(TranscriptEvent.of(final, "hello", "en"))
        assert not await queue.claim(TranscriptEvent.of(final, "hello", "en"))
        assert not await queue.publish_partial(TranscriptPartialEvent.of(hint("d", "partial", 4), "hello", "en"))
        await queue.offer(hint("d", "partial", 5))
        assert await queue.take_hints(10) == []
        await until(lambda: len(events) == 2, 10)
    assert [e["type"] for e in events] == ["transcript_partial", "transcript"]
    history = [json.loads(e)["type"] for e in await publisher_bus.history("hints")]
    assert history == ["transcript"]  # a live caption is not replayed


def test_memory_queue_hint_rules():
    async def body() -> None:
        bus = MemoryBus()
        await hint_rules(MemoryQueue(OrderedPublisher(bus)), bus)

    run(body())


def test_redis_queue_hint_rules(redis_url):
    async def body() -> None:
        bus = RedisBus(redis_url)
        queue = RedisQueue(redis_url, "w1")
        try:
            await hint_rules(queue, bus)
        finally:
            await queue.close()
            await bus.close()

    run(body())


def test_redis_hints_send_each_sample_of_their_utterance_once(redis_url, librivox):
    """Hints of one utterance hold the speech so far: a hint's audio goes to Redis as the part
    that the last one did not hold, each worker still gets the whole of it, and audio that
    expired in Redis is sent whole again; the final deletes it."""
    clip = long_clip(librivox)
    _, hints = segment(np.concatenate([PAUSE, clip, PAUSE]), SegmenterConfig(partial_interval_ms=1000))
    hints = [Utterance(PREFIX + "delta", "hints", "s-delta", "Ann", "en", h.audio, h.start_ts, h.end_of_speech_ts,
                       kind=h.kind, revision=h.revision, digest=audio_digest(h.audio) if h.kind == "speculative" else "")
             for h in hints]
    assert len(hints) >= 4

    async def body() -> None:
        queue = RedisQueue(redis_url, "w-delta")
        raw = redis.Redis.from_url(redis_url)
        key = hint_audio_key(PREFIX + "delta")
        try:
            for i, h in enumerate(hints):
                if i == 2:  # as if it expired: the next hint finds less than it expects and sends all
                    raw.delete(key)
                await queue.offer(h)
                assert raw.strlen(key) == 2 * h.audio.size  # no sample twice, none missing
                (taken,) = await queue.take_hints(10)
                assert (taken.revision, taken.kind) == (h.revision, h.kind)
                # PCM16 both ways: within one step of 16 bits of the segmenter's audio
                assert taken.audio.size == h.audio.size and np.abs(as_float(taken.audio) - h.audio).max() <= 2 / 32768
            await queue.submit(replace(hints[-1], kind="final"))
            assert not raw.exists(key)
        finally:
            raw.close()
            await queue.close()

    run(body())


def test_hints_stay_out_of_the_append_only_file(tmp_path, librivox):
    """Hints are best effort: Redis holds their audio for the workers but writes it neither to
    its append-only file nor to replicas (with 10,000 students speaking it was nearly all Redis
    wrote). A final's job is written as always; after a restart the hint audio is gone and the
    gateway's next hint sends the utterance's audio from its start."""
    _, clip, _ = librivox[1]
    server = RedisServer(persist_dir=tmp_path / "aof").start()

    async def body() -> None:
        queue = RedisQueue(server.url)
        raw = redis.Redis.from_url(server.url)
        first, key = hint("aofhint", "partial", 1, seconds=1.0), hint_audio_key(PREFIX + "aofhint")
        try:
            await queue.offer(first)
            assert raw.strlen(key) == 2 * first.audio.size  # held for the workers
            final = Utterance(PREFIX + "aofjob", "hints", "s-final", "Bo", "en", clip, now() - 3, now())
            await queue.submit(final)
            await asyncio.sleep(0.5)  # the AOF is written each event loop turn, synced each second
            logged = b"".join(f.read_bytes() for f in (tmp_path / "aof").rglob("*.aof"))
            assert final.utterance_id.encode() in logged  # the job, durable
            assert pcm16(first.audio)[:64] not in logged and first.utterance_id.encode() not in logged
            server.stop()
            server.start()
            second = hint("aofhint", "partial", 2, seconds=2.0)
            await queue.offer(second)  # Redis holds less than this gateway sent: all of it again
            assert raw.strlen(key) == 2 * second.audio.size
        finally:
            raw.close()
            await queue.close()

    try:
        run(body())
    finally:
        server.stop()


def speak(audio_of: StudentAudio, audio: np.ndarray):  # noqa: ANN201 - a coroutine
    async def go() -> None:
        for i in range(0, audio.size, 320):  # in real time: 20 ms packets every 20 ms
            audio_of.push_pcm16(audio[i : i + 320])
            await asyncio.sleep(0.02)
    return go()


async def live_class(tiny_engine, queue, bus, publisher, clip: np.ndarray, metrics: Metrics,  # noqa: ANN001
                     room: str) -> list[dict]:
    sink = UtteranceSink(queue, publisher, metrics)
    worker = AsrWorker(tiny_engine, queue, None, max_batch=4, metrics=metrics, partials="on")
    student = StudentAudio(room, "s1", "Ann", "en", sink, config=SegmenterConfig(partial_interval_ms=1000))
    async with collected(bus, room) as events:
        await asyncio.sleep(0.2)
        worker.start()
        await speak(student, np.concatenate([PAUSE, clip, PAUSE]))
        await until(lambda: any(e["type"] == "transcript" for e in events), 60)
        await asyncio.sleep(0.5)  # a late partial would show here
        await worker.stop()
    return events


def check_live_events(events: list[dict], reference: str) -> None:
    kinds = [e["type"] for e in events if e["type"] != "utterance_queued"]
    finals = [e for e in events if e["type"] == "transcript"]
    partials = [e for e in events if e["type"] == "transcript_partial"]
    assert len(finals) == 1, kinds
    assert len(partials) >= 2, kinds
    assert kinds.index("transcript") == len(kinds) - 1  # nothing after the final
    assert {p["utterance_id"] for p in partials} == {finals[0]["utterance_id"]}
    revisions = [p["revision"] for p in partials]
    assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)
    assert partials[0]["published_ts"] < finals[0]["end_of_speech_ts"]  # text while still speaking
    words = set(finals[0]["text"].lower().split())
    assert len(words & set(reference.lower().replace(",", "").replace(".", "").split())) >= len(words) // 2


def test_live_captions_and_a_speculative_final_in_process(tiny_engine, librivox):
    """serve's path: partials while the student speaks, then one final with the same id, taken
    from the speculation (no second recognition): ready when the final comes (used at its end),
    or being recognised then (the worker's final waits for it). The speculation is offered after
    the post-roll, 300 ms before the final, and the worker is between partials then: it takes
    the speculation first."""
    _, clip, reference = max(librivox, key=lambda c: c[1].size)

    async def body() -> tuple[list[dict], Metrics]:
        bus = MemoryBus()
        publisher = OrderedPublisher(bus)
        metrics = Metrics()
        events = await live_class(tiny_engine, MemoryQueue(publisher), bus, publisher, clip, metrics, "live-mem")
        assert [json.loads(e)["type"] for e in await bus.history("live-mem")].count("transcript_partial") == 0
        return events, metrics

    events, metrics = run(body())
    check_live_events(events, reference)
    # The one final came from the one speculation, either way. A counter's label shows at 0 once
    # labels() names it (each recognition names "recognised"), so the values tell, not the names.
    served = {outcome: metrics.registry.get_sample_value("streamserver_speculations_total", {"outcome": outcome}) or 0.0
              for outcome in ("recognised", "used_at_end", "used_by_worker", "waited_for_in_vain")}
    assert served["recognised"] == 1 and served["used_at_end"] + served["used_by_worker"] == 1, served
    assert served["waited_for_in_vain"] == 0, served


def test_live_captions_through_redis(tiny_engine, librivox, redis_url):
    """Gateway + worker path on a real Redis: the same events; partials are not in the history."""
    _, clip, reference = max(librivox, key=lambda c: c[1].size)

    async def body() -> list[dict]:
        bus = RedisBus(redis_url)
        publisher = OrderedPublisher(bus)
        queue = RedisQueue(redis_url, "w-live")
        try:
            room = "live-" + PREFIX
            events = await live_class(tiny_engine, queue, bus, publisher, clip, Metrics(), room)
            history = [json.loads(e)["type"] for e in await bus.history(room)]
            assert "transcript" in history and "transcript_partial" not in history
            return events
        finally:
            await queue.close()
            await bus.close()

    check_live_events(run(body()), reference)


class SlowEngine:
    """The real tiny.en engine, as slow as a busy CPU (each call `delay_s` longer), its
    utterances counted: it holds a speculation in progress long enough to look at."""

    batch_rows_cheap = False  # a CPU's
    caption_policy = None  # captions at the final's window

    def __init__(self, engine, delay_s: float) -> None:  # noqa: ANN001 - an Engine
        self.engine, self.delay_s, self.started, self.recognised = engine, delay_s, 0, 0

    def transcribe_batch(self, audios, language=None, prompt=None):  # noqa: ANN001, ANN201 - Engine's
        self.started += len(audios)
        time.sleep(self.delay_s)
        results = self.engine.transcribe_batch(audios, language)
        self.recognised += len(audios)
        return results


def test_a_final_waits_for_the_speculation_another_worker_is_recognising(tiny_engine, librivox, redis_url):
    """Two workers: A recognises a speculation; its final reaches B meanwhile. B waits for A's
    result and publishes it: one recognition, one transcript. Were A to die, B's wait would end
    with the mark's time (PENDING_S) and B would recognise the final itself."""
    _, clip, _ = librivox[1]

    async def body() -> None:
        gateway = RedisQueue(redis_url)
        a, b = RedisQueue(redis_url, "w-spec-a-" + PREFIX), RedisQueue(redis_url, "w-spec-b-" + PREFIX)
        await a.ensure_group()
        engine = SlowEngine(tiny_engine, 1.0)
        metrics_b = Metrics()
        worker_a = AsrWorker(engine, a, None, partials="off")
        worker_b = AsrWorker(engine, b, None, partials="off", metrics=metrics_b)
        uid, start = PREFIX + "-waits", now() - 3
        final = Utterance(uid, "spec-" + PREFIX, "s-w", "Ann", "en", clip, start, now(), digest=audio_digest(clip))
        try:
            await gateway.offer(Utterance(**{**final.__dict__, "kind": "speculative"}))
            speculating = asyncio.create_task(worker_a._take_hints(False))
            await until(lambda: engine.started == 1, 30)
            await gateway.submit(final)
            entries = [e for e in await b.read(64, 2000) if e[1].utterance_id == uid]  # the session's Redis: others' too
            assert len(entries) == 1
            await worker_b._transcribe(entries)
            assert list(worker_b._deferred) == [entries[0][0]] and engine.started == 1  # waiting, not recognising
            await worker_b._settle_deferred()  # A is still at it: B goes on waiting
            assert worker_b._deferred and not await b.is_done(uid)
            await speculating
            await worker_b._settle_deferred()
            assert not worker_b._deferred and await b.is_done(uid)
            assert engine.recognised == 1  # the speculation only
            assert 'streamserver_speculations_total{outcome="used_by_worker"} 1.0' in metrics_b.render().decode()
        finally:
            for q in (gateway, a, b):
                await q.close()

    run(body())


class CheapRowsEngine(SlowEngine):
    """The real engine, taken for a GPU's: another row in a batch costs little. Its batches are
    noted (how many utterances each)."""

    batch_rows_cheap = True

    def __init__(self, engine) -> None:  # noqa: ANN001 - an Engine
        super().__init__(engine, 0.0)
        self.batches: list[int] = []

    def transcribe_batch(self, audios, language=None, prompt=None):  # noqa: ANN001, ANN201 - Engine's
        self.batches.append(len(audios))
        return super().transcribe_batch(audios, language, prompt)


def test_hint_passes_are_sized_by_full_batches_where_rows_are_cheap(tiny_engine):
    """A GPU worker whose last passes were small (3 rows in 20 ms: 150 utterances/s) still takes
    a full HINT_BUDGET_S of hints at its capacity in its next pass; on a CPU a row costs its own
    time, and the rate is the capacity."""
    queue = MemoryQueue(OrderedPublisher(MemoryBus()))
    gpu = AsrWorker(CheapRowsEngine(tiny_engine), queue, None, max_batch=64)
    gpu._rate, gpu._batch_rows = 150.0, 3.0
    assert gpu.hint_batch_size() == 64
    cpu = AsrWorker(SlowEngine(tiny_engine, 0.0), queue, None, max_batch=64)
    cpu._rate, cpu._batch_rows = 20.0, 1.0
    assert cpu.hint_batch_size() == 2


def test_caption_passes_leave_the_planned_capacity_alone(tiny_engine):
    """Admission plans classes on the worker's rate (capacity()): a pass of captions alone, on a
    CPU three times cheaper a row than a final, moves the busy window but not the rate; the
    finals' passes do."""
    worker = AsrWorker(SlowEngine(tiny_engine, 0.0), MemoryQueue(OrderedPublisher(MemoryBus())), None)
    worker._rate, worker._batch_rows = 5.0, 1.0
    caption = ("", Utterance("u-caption", "r", "s", "S", "en", np.zeros(16000, np.float32), 0.0, 0.0, kind="partial"))
    worker._worked(time.perf_counter() - 0.05, [caption], essential=False)
    assert worker.capacity() == 5.0 and len(worker._busy) == 1
    final = ("1-0", Utterance("u-final", "r", "s", "S", "en", np.zeros(16000, np.float32), 0.0, 0.0))
    worker._worked(time.perf_counter() - 0.5, [final])
    assert 4.0 < worker.capacity() < 5.0  # 2 rows/s measured, smoothed


def test_speculations_ride_along_with_the_finals_where_rows_are_cheap(tiny_engine, librivox, redis_url):
    """On a GPU the queue always holds finals under load, so a speculation taken only between
    batches would never be ready in time: it rides in the finals' batch instead, and its final
    then takes the result without a recognition of its own."""
    (_, first, _), (_, second, _) = librivox[1], librivox[4]

    async def body() -> None:
        gateway, queue = RedisQueue(redis_url), RedisQueue(redis_url, "w-ride-" + PREFIX)
        await queue.ensure_group()
        engine = CheapRowsEngine(tiny_engine)
        worker = AsrWorker(engine, queue, None, partials="off")
        worker._busy.append((time.monotonic() - 5, time.monotonic(), True))  # busy the whole window
        assert worker.hints_taken() == "speculative"  # offered even to a busy GPU worker
        cpu = AsrWorker(SlowEngine(tiny_engine, 0.0), queue, None, partials="off")
        cpu._busy.append((time.monotonic() - 5, time.monotonic(), True))
        assert cpu.hints_taken() == "none"  # a busy CPU worker takes none: each row costs it an encoder run
        room = "ride-" + PREFIX
        final = Utterance(PREFIX + "-ride-final", room, "s-a", "Ann", "en", first, now() - 3, now())
        later = Utterance(PREFIX + "-ride-later", room, "s-b", "Bo", "en", second, now() - 3, now(), digest=audio_digest(second))
        try:
            await gateway.submit(final)
            await gateway.offer(Utterance(**{**later.__dict__, "kind": "speculative"}))
            # (the session's Redis may hold other tests' jobs: only this test's are taken on)
            entries = [e for e in await queue.read(64, 2000) if e[1].utterance_id == final.utterance_id]
            await worker._transcribe(entries)
            assert engine.batches == [2]  # one engine call: the final and the speculation
            assert await queue.is_done(final.utterance_id)
            kept = (await queue.speculations([later.utterance_id]))[later.utterance_id]
            assert kept.final_for(later) is not None
            await gateway.submit(later)
            entries = [e for e in await queue.read(64, 2000) if e[1].utterance_id == later.utterance_id]
            assert len(entries) == 1
            await worker._transcribe(entries)
            assert engine.batches == [2] and await queue.is_done(later.utterance_id)  # no second recognition
        finally:
            await gateway.close()
            await queue.close()

    run(body())



def test_a_rider_of_another_language_is_held_for_a_pass_of_its_own(tiny_engine, librivox):
    """A hint taken to ride in a batch whose finals are all of another language (an engine call
    of its own) is not dropped: it waits in the worker and is recognised in the next pass
    between batches."""
    (_, first, _), (_, second, _) = librivox[1], librivox[4]

    async def body() -> None:
        queue = MemoryQueue(OrderedPublisher(MemoryBus()))
        engine = CheapRowsEngine(tiny_engine)
        worker = AsrWorker(engine, queue, None, partials="off")
        room = "held-" + PREFIX
        final = Utterance(PREFIX + "-held-final", room, "s-a", "Ann", "en", first, now() - 3, now())
        other = Utterance(PREFIX + "-held-other", room, "s-b", "Bo", "auto", second, now() - 3, now(), kind="speculative",
                          digest=audio_digest(second))  # "auto": the language is detected, a group of its own
        await queue.submit(final)
        await queue.offer(other)
        await worker._transcribe(await queue.read(64, 100))
        assert engine.batches == [1] and await queue.done_of([final.utterance_id]) == {final.utterance_id}  # the final alone
        assert await queue.take_hints(10) == []  # taken from the queue: the worker holds it
        await worker._take_hints(False)
        assert engine.batches == [1, 1]
        kept = (await queue.speculations([other.utterance_id]))[other.utterance_id]
        assert kept.final_for(other) is not None  # its final will need no recognition

    run(body())


def test_held_hints_published_meanwhile_or_captions_turned_off_do_not_ride(tiny_engine, librivox):
    """What the worker holds is checked again when it is taken: a hint whose final was published
    meanwhile is dropped, a held partial does not ride once captions are off (auto, a busy
    engine), and a fresh speculation goes before a held partial."""
    (_, first, _), (_, second, _) = librivox[1], librivox[4]

    async def body() -> None:
        queue = MemoryQueue(OrderedPublisher(MemoryBus()))
        engine = CheapRowsEngine(tiny_engine)
        worker = AsrWorker(engine, queue, None, max_batch=2, partials="auto")
        room = "recheck-" + PREFIX
        final = Utterance(PREFIX + "-recheck-final", room, "s-a", "Ann", "en", first, now() - 3, now())
        published = replace(hint("recheck-done", "speculative"), room_id=room)
        held_partial = replace(hint("recheck-partial", "partial", revision=1), room_id=room)
        fresh = Utterance(PREFIX + "-recheck-spec", room, "s-c", "Cy", "en", second, now() - 3, now(), kind="speculative",
                          digest=audio_digest(second))
        worker._hold([published, held_partial])
        queue._published.remember(published.utterance_id)  # its final was published meanwhile (by another worker)
        await queue.submit(final)
        await queue.offer(fresh)
        riders = await worker._riders(await queue.read(64, 100))  # room for one rider
        assert [u.utterance_id for _, u in riders] == [fresh.utterance_id]  # speculative first; the published one gone
        assert list(worker._held_hints) == [held_partial.utterance_id]
        worker._busy.append((time.monotonic() - 5, time.monotonic(), True))  # busy: captions off (auto)
        assert not worker.partial_riders()
        assert await worker._riders(await queue.read(64, 100) or [("x", final)]) == [] and worker._held_hints == {}

    run(body())


class OrderQueue(MemoryQueue):
    """A memory queue that notes what the worker published, in order."""

    def __init__(self) -> None:
        super().__init__(OrderedPublisher(MemoryBus()))
        self.published: list[str] = []

    async def complete(self, entry_id, u, event):  # noqa: ANN001, ANN201 - MemoryQueue's
        self.published.append(event.type)
        return await super().complete(entry_id, u, event)

    async def publish_partial(self, event):  # noqa: ANN001, ANN201 - MemoryQueue's
        self.published.append(event.type)
        return await super().publish_partial(event)


def test_a_batch_publishes_its_finals_before_its_riders_captions(tiny_engine, librivox):
    """Finals always go first: a caption that rode in the batch (a partial, or a speculation's
    text) is published after the batch's finals, never in front of them."""
    (_, first, _), (_, second, _) = librivox[1], librivox[4]

    async def body() -> None:
        queue = OrderQueue()
        worker = AsrWorker(CheapRowsEngine(tiny_engine), queue, None, partials="on")
        room = "order-" + PREFIX
        final = Utterance(PREFIX + "-order-final", room, "s-a", "Ann", "en", first, now() - 3, now())
        speaking = Utterance(PREFIX + "-order-partial", room, "s-b", "Bo", "en", second[: 2 * RATE], now() - 2, now(),
                             kind="partial", revision=1)
        pausing = Utterance(PREFIX + "-order-spec", room, "s-c", "Cy", "en", second, now() - 3, now(), kind="speculative",
                            digest=audio_digest(second))
        await queue.submit(final)
        await queue.offer(speaking)
        await queue.offer(pausing)
        await worker._transcribe(await queue.read(64, 100))
        assert queue.published == ["transcript", "transcript_partial", "transcript_partial"]

    run(body())


class CountingIntent:
    """The real intent classifier, the texts it was asked to label noted."""

    def __init__(self) -> None:
        from streamserver.intent.model import EmbeddingIntentClassifier

        self.classifier, self.labelled = EmbeddingIntentClassifier(), []

    def classify(self, texts):  # noqa: ANN001, ANN201 - IntentClassifier's
        self.labelled += texts
        return self.classifier.classify(texts)


def test_partials_ride_along_on_a_gpu_with_headroom_and_get_no_label(tiny_engine, librivox, redis_url):
    """On a GPU under load the queue always holds finals, so a caption taken only between batches
    would wait for seconds: while the engine has headroom, partials ride in the finals' batch,
    are published as captions, and cost no intent label. A busy GPU worker (auto) takes
    speculative riders only."""
    (_, first, _), (_, second, _) = librivox[1], librivox[4]

    async def body() -> None:
        gateway, queue = RedisQueue(redis_url), RedisQueue(redis_url, "w-ride-p-" + PREFIX)
        await queue.ensure_group()
        engine, intent, metrics = CheapRowsEngine(tiny_engine), CountingIntent(), Metrics()
        worker = AsrWorker(engine, queue, intent, partials="auto", metrics=metrics)
        assert worker.partial_riders() and worker.hints_taken() == "all"  # an idle GPU worker
        room = "ride-p-" + PREFIX
        final = Utterance(PREFIX + "-ridep-final", room, "s-a", "Ann", "en", first, now() - 3, now())
        speaking = Utterance(PREFIX + "-ridep-partial", room, "s-b", "Bo", "en", second[: 2 * RATE], now() - 2, now(),
                             kind="partial", revision=1)
        try:
            await gateway.submit(final)
            await gateway.offer(speaking)
            entries = [e for e in await queue.read(64, 2000) if e[1].utterance_id == final.utterance_id]
            await worker._transcribe(entries)
            assert engine.batches == [2]  # one engine call: the final and the caption
            assert await queue.is_done(final.utterance_id)
            assert 'streamserver_partials_total{outcome="published"} 1.0' in metrics.render().decode()
            assert len(intent.labelled) == 1  # the final's text only
            worker._busy.append((time.monotonic() - 5, time.monotonic(), True))  # busy the whole window
            assert not worker.partial_riders() and worker.hints_taken() == "speculative"
            assert AsrWorker(engine, queue, None, partials="off").partial_riders() is False
        finally:
            await gateway.close()
            await queue.close()

    run(body())
