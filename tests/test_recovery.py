"""Nothing a student says is lost across a break (issue 17), with clients that keep their audio:
the load simulator's WebSocket students here (the student page over WebRTC: tests/test_browser_recovery.py).

A real `serve --redis-url` is SIGKILLed while a student speaks and started again: the student
reconnects, sends what the server had not acknowledged, and every sentence reaches the class
transcript once, in order. The unit tests pin the parts: the segmenter's safe point, the stream
clock, a copy of a published utterance suppressed by both queues.
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import numpy as np
import pytest

from streamserver.audio.pipeline import StudentAudio
from streamserver.audio.segmenter import UtteranceSegmenter
from streamserver.audio.timeline import StreamClock
from streamserver.bus.memory import MemoryBus
from streamserver.bus.ordered import OrderedPublisher
from streamserver.events import TranscriptEvent, Utterance, now
from streamserver.loadsim.clients import create_room, link_param
from streamserver.loadsim.ws_student import WsStudent
from streamserver.queue.publication import covered, spoken_of
from streamserver.queue.memory_queue import MemoryQueue
from streamserver.queue.redis_queue import RedisQueue
from tests.recovery_track import match_sentences, pcm16, track, wer
from tests.server_process import ADMIN_TOKEN, ServerProcess, free_port
from tests.takers import SpeechList, UtteranceList


def test_the_safe_point_is_the_start_of_the_speech_in_progress(librivox):
    audio = librivox[1][1]
    emitted = SpeechList()
    seg = UtteranceSegmenter(out=emitted)
    silence = np.zeros(16000, np.int16)
    seg.feed(silence)
    assert seg.safe_sample > 16000 - 16000 // 2  # idle: only the pre-roll and start window are held
    seg.feed(pcm16_array(audio[: audio.size // 2]))
    assert seg.speaking and seg.safe_sample < 16000  # the utterance began within the first second's pre-roll
    held_at = seg.safe_sample
    seg.feed(pcm16_array(audio[audio.size // 2 :]))
    seg.feed(silence)
    [speech] = emitted
    assert speech.first_sample == held_at  # what was held is where the utterance starts
    assert seg.safe_sample >= speech.first_sample + speech.audio.size  # after it: safe (once published)


def pcm16_array(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1, 1) * 32767).astype(np.int16)


def test_the_stream_clock_places_runs_and_marks():
    clock = StreamClock()
    clock.add_run(0, 10.0)
    assert clock.at(16000) == pytest.approx(11.0)
    clock.add_run(32000, None)  # live audio: placed by the first mark
    assert clock.at(32000) is None
    clock.place(40.0)
    clock.place(50.0)  # the first mark decides
    assert clock.at(48000) == pytest.approx(41.0) and clock.at(16000) == pytest.approx(11.0)


def test_live_audio_waits_behind_a_catch_up_and_follows_it(librivox):
    """The VAD sees the catch-up, then the live audio held meanwhile: one stream, in order."""
    emitted = UtteranceList()
    audio = StudentAudio("r", "s", "Ann", "en", emitted, pacer=_unpaced())
    audio.keep(catch_up=True)
    sentence = pcm16_array(librivox[1][1])
    silence = np.zeros(16000, np.int16)
    audio.push_pcm16(silence)  # live, held
    assert audio.mark(50.0) == pytest.approx(49.0)  # 1 s of live audio received before the mark at 50 s
    audio.start_catch_up(40.0, pacer=_unpaced())
    for piece in np.array_split(np.concatenate([silence, sentence, silence]), 20):
        audio.push_catch_up(piece)
    assert len(emitted) == 1 and emitted[0].recovered
    assert emitted[0].stream_span[0] == pytest.approx(41.0, abs=0.35)  # the sentence began 1 s into the catch-up
    audio.push_pcm16(sentence)  # live, still held
    audio.end_catch_up(complete=True)
    audio.push_pcm16(np.concatenate([silence, silence]))
    assert len(emitted) == 2 and not emitted[1].recovered
    assert emitted[1].stream_span[0] == pytest.approx(50.0, abs=0.35)  # after the held second of silence
    assert audio.ack() is not None and audio.ack() <= emitted[0].stream_span[0]  # nothing published yet
    audio.settle({u.utterance_id for u in emitted})
    assert audio.ack() >= emitted[1].stream_span[1]


def test_a_catch_up_that_stops_short_is_never_acknowledged_past_its_hole(librivox):
    """Given up (the page went quiet mid-way): the live audio goes on, but what the catch-up did
    not bring stays unacknowledged, so the page keeps it for its next break."""
    audio = StudentAudio("r", "s", "Ann", "en", UtteranceList(), pacer=_unpaced())
    audio.keep(catch_up=True)
    audio.push_pcm16(np.zeros(16000, np.int16))
    audio.mark(50.0)
    audio.start_catch_up(40.0, pacer=_unpaced())
    audio.push_catch_up(np.zeros(3 * 16000, np.int16))  # 40..43 of 40..49
    audio.end_catch_up()  # given up
    audio.push_pcm16(np.zeros(5 * 16000, np.int16))
    assert audio.ack() is not None and audio.ack() <= 43.0 + 1e-6
    audio.close()
    assert audio.ack() is None  # closed: nothing more is promised


def test_bad_recovery_messages_get_a_clear_error_and_never_hold_live_audio():
    from streamserver.audio.pacing import Pacer, TooFast
    from streamserver.transport.recovery import ChannelError, handle

    sent: list[dict] = []
    audio = StudentAudio("r", "s", "Ann", "en", UtteranceList(), pacer=_unpaced())
    audio.keep(catch_up=False)
    for bad in ("not json", "[1]", '{"type": "mark", "t": "soon"}', '{"type": "mark", "t": -1}', '{"type": "dance"}',
                '{"type": "catchup", "from": 1}', "x" * 300, b"\x00", b"\x00" * 70000):
        with pytest.raises(ChannelError):
            handle(audio, bad, sent.append, _unpaced)
    with pytest.raises(ChannelError):  # audio for a catch-up that was never announced
        handle(audio, b"\x00\x00" * 160, sent.append, _unpaced)
    handle(audio, '{"type": "mark", "t": 12.5}', sent.append, _unpaced)
    assert sent == [{"type": "live_from", "t": 12.5}]
    # A catch-up faster than the pacing limits is refused (the channel closes; live audio goes on).
    held = StudentAudio("r", "s", "Ann", "en", UtteranceList(), pacer=_unpaced())
    held.keep(catch_up=True)
    handle(held, '{"type": "catchup", "from": 3}', sent.append, Pacer)  # the default limits: 1.5x real time
    with pytest.raises(TooFast):
        for _ in range(100):
            handle(held, b"\x00\x00" * 16000, sent.append, _unpaced)


def _unpaced():
    from streamserver.audio.pacing import Pacer

    return Pacer(rate=1000.0, burst_s=1000.0, initial_s=1000.0)


def _final(span: tuple[float, float], recovered: bool, clock: str = "c1") -> TranscriptEvent:
    u = Utterance(uuid_hex(), "r", "s", "Ann", "en", np.zeros(160, np.float32), now(), now(),
                  stream_span=span, recovered=recovered, stream_clock=clock)
    return TranscriptEvent.of(u, "hello", "en")


def uuid_hex() -> str:
    import uuid

    return uuid.uuid4().hex


def test_a_copy_of_a_published_utterance_is_not_published_again(redis_url):
    """Both queues: the same speech sent again (its span on the student's clock covered by a
    published one) publishes nothing; speech next to it does, and so does speech of another clock
    (the page reloaded: its clock starts at 0 again) and new speech the VAD merged with a copy."""
    assert covered([(10.0, 13.0, False)], 10.2, 12.9, True) and not covered([(10.0, 13.0, False)], 13.1, 15.0, True)
    assert not covered([(10.0, 13.0, False)], 10.2, 12.9, False)  # two live utterances never are copies
    assert not covered([(10.0, 13.0, False)], 10.0, 20.0, True)  # 7 s of new speech: published, not lost

    async def body() -> None:
        bus = MemoryBus()
        memory = MemoryQueue(OrderedPublisher(bus))
        redis_queue = RedisQueue(redis_url, "w")
        for queue in (memory, redis_queue):
            assert await queue.claim(_final((10.0, 13.0), False))
            assert not await queue.claim(_final((10.1, 12.8), True))  # the copy
            assert await queue.claim(_final((14.0, 16.0), True))  # recovered, new
            copy = _final((14.05, 16.1), True)
            assert not await queue.claim(copy)
            assert await queue.done_of([copy.utterance_id]) == {copy.utterance_id}  # settled: no resending
            assert await queue.claim(_final((10.1, 12.8), False, clock="c2"))  # a reload's new clock
            assert await queue.claim(_final((20.0, 23.0), True))  # a recovered copy published first ...
            assert not await queue.claim(_final((20.1, 22.9), False))  # ... then its original is the copy
        await redis_queue.close()

    asyncio.run(body())


async def _speak_through_a_crash(url: str, audio: np.ndarray, restart) -> tuple[WsStudent, dict]:  # noqa: ANN001
    """One student speaking `audio` in real time; `restart()` (in a thread) at 40 % of it."""
    async with aiohttp.ClientSession() as session:
        room = await create_room(session, url, ADMIN_TOKEN, "recovery class", "en")
        student = WsStudent(session, url, room, "Ann", "", keeps=True)
        await student.connect()
        pcm = pcm16(audio)
        frame = 640  # 20 ms
        began = time.monotonic()
        crash = None
        for i, at in enumerate(range(0, len(pcm), frame)):
            await student.send(pcm[at : at + frame])
            if crash is None and at >= 0.4 * len(pcm):
                crash = asyncio.create_task(asyncio.to_thread(restart))
            delay = began + (i + 1) * 0.02 - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        if crash is not None:
            await crash
        await student.close()
        return student, room


def _finals(url: str, room: dict, expected: int, timeout_s: float = 90) -> list[dict]:
    import json
    import urllib.request

    token = link_param(room["teacher_url"], "token")
    deadline = time.time() + timeout_s
    while True:
        with urllib.request.urlopen(f"{url}/api/rooms/{room['room_id']}/transcript?format=json&token={token}") as r:
            finals = json.load(r)["transcripts"]
        if len(finals) >= expected or time.time() > deadline:
            return finals
        time.sleep(1.0)


def test_a_server_killed_while_a_student_speaks_loses_nothing(redis_url):
    """SIGKILL of `serve --redis-url` mid-sentence, started again 3 s later on the same port: every
    sentence once, in order, the ones around the crash marked recovered."""
    audio, texts, _starts = track()
    port = free_port()
    servers = [ServerProcess("--redis-url", redis_url, port=port)]

    def restart() -> None:
        servers[0].proc.send_signal(signal.SIGKILL)
        servers[0].proc.wait(10)
        time.sleep(3)
        servers.append(ServerProcess("--redis-url", redis_url, port=port))

    try:
        student, room = asyncio.run(_speak_through_a_crash(servers[0].url, audio, restart))
        finals = _finals(servers[-1].url, room, len(texts))
    finally:
        for server in servers:
            server.stop()
    heard = [f["text"] for f in finals]
    print(f"reconnects {student.reconnects}, resent {student.resent_s:.1f} s, WER {wer(texts, heard):.3f}, "
          f"recovered {sum(bool(f.get('recovered')) for f in finals)} of {len(finals)}")
    assert student.reconnects >= 1 and student.resent_s > 0
    assert match_sentences(texts, heard) == list(range(len(texts))), heard
    assert any(f.get("recovered") for f in finals)
    assert wer(texts, heard) < 0.15


def test_one_slow_client_does_not_hold_up_the_others_acks():
    """Acks go out side by side: a client whose send waits (its socket's buffer full) is given
    up after the round's time, and the others' acks have gone out meanwhile."""
    from streamserver.rooms.acks import _sent_together

    async def body() -> tuple[list[str], bool, float]:
        sent: list[str] = []
        stuck = asyncio.Event()

        async def tell(name: str, slow: bool) -> None:
            if slow:
                await stuck.wait()  # never set: a client that stopped reading
            sent.append(name)

        sends = [asyncio.ensure_future(tell(n, n == "slow")) for n in ("a", "slow", "b", "c")]
        started = time.monotonic()
        await _sent_together(sends, 0.3)
        took = time.monotonic() - started
        await asyncio.sleep(0)  # the cancellation lands
        return sent, sends[1].cancelled(), took

    sent, cancelled, took = asyncio.run(body())
    assert sent == ["a", "b", "c"] and cancelled and took < 1.0


def test_speech_queued_before_a_break_is_not_cut_again_from_its_resend(librivox):
    """A page that lost its acks sends again speech whose utterance is queued already: its
    samples are silenced before the VAD (audio/sent_again.py), so only the speech in progress at
    the break becomes an utterance, whole; sent again unmasked, the queued one comes out twice."""
    silence = np.zeros(16000, np.int16)
    first, second = pcm16_array(librivox[1][1]), pcm16_array(librivox[2][1])
    before_break = np.concatenate([silence, first, silence, second[: second.size // 2]])
    after_break = np.concatenate([second[second.size // 2 :], silence])

    queued = UtteranceList()
    live = StudentAudio("r", "s", "Ann", "en", queued, pacer=_unpaced())
    live.keep(False, start=0.0, stream_now=0.0, clock="c1")
    live.push_pcm16(before_break)
    live.close(flush=False)  # a break: the speech in progress is the page's to send again
    [held] = queued
    assert held.stream_span is not None

    def resend(already: list[tuple[float, float]]) -> list[Utterance]:
        emitted = UtteranceList()
        audio = StudentAudio("r", "s", "Ann", "en", emitted, pacer=_unpaced())
        audio.keep(False, start=0.0, live_from=before_break.size / 16000, stream_now=0.0, clock="c1")
        audio.already_sent(already)
        for piece in np.array_split(np.concatenate([before_break, after_break]), 40):
            audio.push_pcm16(piece)
        return emitted

    [new] = resend([held.stream_span])
    assert new.recovered and new.stream_span[0] >= held.stream_span[1] - 0.05
    second_starts = (2 * 16000 + first.size) / 16000
    assert new.stream_span[0] <= second_starts + 0.1  # the speech in progress, from its start ...
    assert new.audio.size >= second.size  # ... to its end: nothing of it lost
    assert len(resend([])) == 2  # unmasked: the queued speech a second time


def test_both_queues_know_where_queued_utterances_lie_before_they_are_published(redis_url):
    async def body() -> None:
        memory = MemoryQueue(OrderedPublisher(MemoryBus()))
        redis_queue = RedisQueue(redis_url, "w")
        for queue in (memory, redis_queue):
            u = Utterance(uuid_hex(), "r-sent", "s", "Ann", "en", np.zeros(160, np.float32), now(), now(),
                          stream_span=(3.0, 5.5), recovered=False, stream_clock="c7")
            await queue.submit(u)
            assert await queue.sent_spans("r-sent", spoken_of("s", "c7")) == [(3.0, 5.5)]  # in flight: known
            assert await queue.sent_spans("r-sent", spoken_of("s", "c8")) == []  # a reload's clock: new
            assert await queue.claim(TranscriptEvent.of(u, "hello", "en"))
            assert (3.0, 5.5) in await queue.sent_spans("r-sent", spoken_of("s", "c7"))
        await redis_queue.close()

    asyncio.run(body())
