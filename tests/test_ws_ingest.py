"""WebSocket ingest end to end: a real `streamserver serve` with Redis, raw WebSocket students."""

from __future__ import annotations

import asyncio
import json
import time
from fractions import Fraction

import aiohttp
import av
import numpy as np
import pytest

from benchmarks.scoring import wer
from streamserver.loadsim.clients import Dashboard, create_room, token_of
from streamserver.rooms import tokens
from tests.server_process import ADMIN_TOKEN, ServerProcess

SECRET = "ws-ingest-test-secret"  # known to the test, so it can sign a token for a room that does not exist


@pytest.fixture(scope="module")
def server(redis_url):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STREAMSERVER_SECRET", SECRET)  # the server process inherits it
        with ServerProcess("--redis-url", redis_url, "--max-students", "2") as server:
            yield server


def pcm16(audio: np.ndarray, lead_s: float = 0.5, tail_s: float = 1.0) -> bytes:
    """The clip with silence around it: the tail lets the VAD's hangover end the utterance."""
    pad = lambda s: np.zeros(int(s * 16000), np.float32)  # noqa: E731
    return (np.clip(np.concatenate([pad(lead_s), audio, pad(tail_s)]), -1, 1) * 32767).astype("<i2").tobytes()


def ingest_url(server: ServerProcess, room: dict, name: str, token: str | None = None, extra: dict | None = None) -> str:
    query = {"token": token or token_of(room["student_url"]), "name": name, **(extra or {})}
    return server.url.replace("http", "ws") + "/ws/ingest?" + "&".join(f"{k}={v}" for k, v in query.items())


async def wait_for(dashboard: Dashboard, name: str, timeout: float = 60) -> list[dict]:
    for _ in range(int(timeout * 10)):
        if found := [t for t in dashboard.transcripts() if t["student_name"] == name]:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"no transcript of {name}")


async def send_paced(ws: aiohttp.ClientWebSocketResponse, chunks: list[bytes], chunk_s: float) -> None:
    """The first 0.6 s at once, the rest at 1.3x real time: within what the server accepts of a
    live stream (1 s, then 1.5x: streamserver/audio/pacing.py), and faster than speech."""
    start = time.monotonic()
    for i, chunk in enumerate(chunks):
        await ws.send_bytes(chunk)
        ahead = (i * chunk_s - 0.6) / 1.3 - (time.monotonic() - start)
        await asyncio.sleep(max(ahead, 0.0))


async def send_frames(ws: aiohttp.ClientWebSocketResponse, data: bytes, frame: int = 640) -> None:
    await send_paced(ws, [data[i : i + frame] for i in range(0, len(data), frame)], frame / 2 / 16000)


async def speak(s: aiohttp.ClientSession, server: ServerProcess, room: dict, dashboard: Dashboard, name: str,
                audio: np.ndarray, tail_s: float = 1.0) -> list[dict]:
    """A student says `audio` over the ingest and hangs up; its transcripts on the dashboard."""
    async with s.ws_connect(ingest_url(server, room, name)) as ws:
        await ws.receive_json(timeout=10)
        await send_frames(ws, pcm16(audio, tail_s=tail_s))
    return await wait_for(dashboard, name)


def test_pcm16_student_is_transcribed_with_intent(server, librivox):
    _, audio, reference = librivox[0]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            room = await create_room(s, server.url, ADMIN_TOKEN, "ws class")
            dashboard = await Dashboard().open(s, server.url, room)
            # A student_id the client names without its resume secret proves nothing: the server
            # issues the student's identity (streamserver/rooms/identity.py).
            async with s.ws_connect(ingest_url(server, room, "Wes", extra={"student_id": "ws-student-0001"})) as ws:
                ready = await ws.receive_json(timeout=10)
                student_id = ready.pop("student_id")
                assert student_id != "ws-student-0001" and len(ready.pop("resume")) >= 40
                assert ready == {"type": "ready", "room_id": room["room_id"], "sample_rate": 16000, "format": "pcm16"}
                await send_frames(ws, pcm16(audio))
                [transcript] = await wait_for(dashboard, "Wes")
            assert transcript["student_id"] == student_id and transcript["room_id"] == room["room_id"]
            assert wer([reference], [transcript["text"]]) <= 0.2, transcript["text"]
            assert set(transcript["intent"]) == {"label", "score"}
            assert transcript["published_ts"] >= transcript["end_of_speech_ts"] >= transcript["start_ts"]
            kinds = [e["type"] for e in dashboard.events if e.get("student_id") == student_id and e["type"] != "utterance_queued"]
            assert kinds[:2] == ["student_joined", "speaking_started"] and "speaking_stopped" in kinds
            await dashboard.close()

    asyncio.run(scenario())


def test_closing_mid_utterance_flushes_it(server, librivox):
    """No trailing silence: the close itself ends the utterance, which is still transcribed."""

    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            room = await create_room(s, server.url, ADMIN_TOKEN, "flush")
            dashboard = await Dashboard().open(s, server.url, room)
            assert (await speak(s, server, room, dashboard, "Flo", librivox[4][1], tail_s=0))[0]["text"]
            await dashboard.close()

    asyncio.run(scenario())


def test_opus_packets(server, librivox):
    _, audio, reference = librivox[3]
    encoder = av.CodecContext.create("libopus", "w")
    encoder.sample_rate, encoder.layout, encoder.format, encoder.time_base = 48000, "mono", "s16", Fraction(1, 48000)
    resampled = np.interp(np.arange(0, audio.size, 1 / 3), np.arange(audio.size), audio)  # 16 -> 48 kHz
    pcm = (np.clip(np.concatenate([resampled, np.zeros(48000)]), -1, 1) * 32767).astype(np.int16)
    packets = []
    for i in range(0, pcm.size - 960 + 1, 960):
        frame = av.AudioFrame.from_ndarray(pcm[None, i : i + 960], format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48000, i
        packets += [bytes(p) for p in encoder.encode(frame)]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            room = await create_room(s, server.url, ADMIN_TOKEN, "opus")
            dashboard = await Dashboard().open(s, server.url, room)
            async with s.ws_connect(ingest_url(server, room, "Ola")) as ws:
                assert (await ws.receive_json(timeout=10))["format"] == "pcm16"
                await ws.send_str(json.dumps({"format": "opus"}))
                assert await ws.receive_json(timeout=10) == {"type": "format", "format": "opus", "sample_rate": 48000}
                await send_paced(ws, packets, 960 / 48000)
                heard = await wait_for(dashboard, "Ola")
                await asyncio.sleep(1.0)  # in case the decoded audio was cut in two
            text = " ".join(t["text"] for t in dashboard.transcripts())
            assert wer([reference], [text]) <= 0.2, text
            assert heard
            await dashboard.close()

    asyncio.run(scenario())


def test_refusals_before_the_upgrade(server):
    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            a, b = await create_room(s, server.url, ADMIN_TOKEN, "A"), await create_room(s, server.url, ADMIN_TOKEN, "B")
            student_a = token_of(a["student_url"])

            async def status(url: str) -> int:
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await s.ws_connect(url)
                return refused.value.status

            assert await status(ingest_url(server, a, "x", token=student_a[:-3] + "xyz")) == 401
            assert await status(server.url.replace("http", "ws") + "/ws/ingest?name=x") == 401
            assert await status(ingest_url(server, a, "x", token=token_of(a["teacher_url"]))) == 403
            assert await status(ingest_url(server, a, "x", extra={"room": b["room_id"]})) == 403  # the token is room A's
            assert await status(ingest_url(server, a, "x", token=tokens.issue(SECRET, "nosuchroom", "student", 60))) == 404
            assert await status(ingest_url(server, a, "")) == 400  # a name is required
            async with s.ws_connect(ingest_url(server, a, "one")), s.ws_connect(ingest_url(server, a, "two")):
                assert await status(ingest_url(server, a, "three")) == 429  # --max-students 2

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "bad, code, words",
    [
        (b"\x00" * 641, 1007, "even byte count"),
        (b"\x00" * (64 * 1024 + 2), 1009, "over"),
        ("hello", 1003, "format"),
    ],
)
def test_bad_input_closes_that_stream_only(server, librivox, bad, code, words):
    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            room = await create_room(s, server.url, ADMIN_TOKEN, "bad input")
            dashboard = await Dashboard().open(s, server.url, room)
            async with s.ws_connect(ingest_url(server, room, "Bad")) as ws:
                await ws.receive_json(timeout=10)
                await ws.send_bytes(bytes(6400))  # some good audio first
                await (ws.send_bytes(bad) if isinstance(bad, bytes) else ws.send_str(bad))
                error = await ws.receive_json(timeout=10)
                assert error["type"] == "error" and words in error["error"]
                closing = await ws.receive(timeout=10)
                assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED) and ws.close_code == code
            # The room, and the server, go on serving the next student.
            assert (await speak(s, server, room, dashboard, "Good", librivox[4][1]))[0]["text"]
            await dashboard.close()

    asyncio.run(scenario())


def test_reconnect_replaces_the_old_stream(server):
    """The same student connecting again (its id and resume secret) takes over its seat; the old
    socket is told and closed."""

    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            room = await create_room(s, server.url, ADMIN_TOKEN, "reconnect")
            async with s.ws_connect(ingest_url(server, room, "Rey")) as old:
                first = await old.receive_json(timeout=10)
                again = ingest_url(server, room, "Rey", extra={"student_id": first["student_id"], "resume": first["resume"]})
                async with s.ws_connect(again) as new:
                    assert (await new.receive_json(timeout=10))["student_id"] == first["student_id"]
                    # A silent old stream is told and closed at once; one that keeps sending: the
                    # next test.
                    assert "replaced" in (await old.receive_json(timeout=10))["error"]
                    await old.receive(timeout=10)
                    assert old.close_code == 4001
                    await new.send_bytes(bytes(640))  # the new stream goes on
                    assert not new.closed

    asyncio.run(scenario())


def test_a_replaced_stream_that_keeps_sending_still_reads_why(server):
    """Two tabs of one student, both sending: the older tab must learn it was replaced (its
    notice, then close code 4001), or its page takes the close for a broken network and connects
    again, replacing the newer tab in turn. The old stream sends 20 ms frames all along, so the
    server's close meets audio it has not read: closed from outside the stream's reader, aiohttp
    dropped the connection at once and the kernel's reset could cost the client the close frame
    (1006). Ten takeovers in a row, each must end in 4001."""

    async def keep_sending(ws: aiohttp.ClientWebSocketResponse) -> None:
        while not ws.closed:
            try:
                await ws.send_bytes(bytes(640))
            except (ConnectionError, RuntimeError):  # closing under us: the test reads why
                return
            await asyncio.sleep(0.02)

    async def scenario() -> list[int | None]:
        codes: list[int | None] = []
        async with aiohttp.ClientSession() as s:
            room = await create_room(s, server.url, ADMIN_TOKEN, "two-tabs")
            old = await s.ws_connect(ingest_url(server, room, "Tab"))
            first = await old.receive_json(timeout=10)
            again = ingest_url(server, room, "Tab", extra={"student_id": first["student_id"], "resume": first["resume"]})
            for _ in range(10):
                sender = asyncio.create_task(keep_sending(old))
                await asyncio.sleep(0.2)  # the old tab's audio is flowing
                new = await s.ws_connect(again)
                assert (await new.receive_json(timeout=10))["student_id"] == first["student_id"]
                notice = await old.receive(timeout=10)
                assert notice.type == aiohttp.WSMsgType.TEXT and "replaced" in json.loads(notice.data)["error"], notice
                await old.receive(timeout=10)
                codes.append(old.close_code)
                await sender
                old = new
            await old.close()
        return codes

    assert asyncio.run(scenario()) == [4001] * 10
