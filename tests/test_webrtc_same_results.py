"""The same speech over every transport cuts the same utterances (issue 13, must-show 3): two
LibriVox clips in one stream, sent by an aiortc student over WebRTC (the server's receiver that
decodes in the event loop, transport/rtp_audio.py), over the WebSocket ingest (PCM16), and over
WebRTC the way the server decoded before (aiortc's decoder thread, 48 kHz stereo, resampled:
StudentAudio.push_frame), all into one `serve` app in this process with its real tiny.en worker.

Each stream's audio as the VAD got it is recorded, and every utterance is found in it (its
frames are the stream's own samples), so the boundaries are compared in stream time from the
speech's onset: they must agree within one VAD frame (30 ms), and the transcripts must be equal.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from fractions import Fraction

import aiohttp
import av
import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from aiortc import RTCConfiguration, RTCPeerConnection
from aiortc.codecs.opus import OpusEncoder
from aiortc.contrib.media import MediaPlayer
from aiortc.mediastreams import MediaStreamError

from streamserver.audio.pipeline import StudentAudio
from streamserver.classroom import Classroom
from streamserver.config import Settings
from streamserver.events import Utterance
from streamserver.loadsim.clients import Dashboard, create_room, join_student, speech_file, token_of
from streamserver.server import serve_app

ADMIN = "same-results-admin"
RATE = 16000
FRAME = 480  # the VAD's 30 ms
ONSET = 1000  # |sample| that marks the speech's start in a stream


def onset(stream: np.ndarray) -> int:
    return int(np.flatnonzero(np.abs(stream.astype(np.int32)) > ONSET)[0])


def boundaries(stream: np.ndarray, utterance_audio: np.ndarray) -> tuple[int, int]:
    """Where an utterance's audio lies in the stream it was cut from (samples, from the onset)."""
    pcm = np.round(utterance_audio * 32768).astype(np.int16)
    starts = np.arange(0, stream.size - pcm.size + 1, FRAME)  # the segmenter cuts whole frames
    first = np.flatnonzero(np.all(stream[starts[:, None] + np.arange(FRAME)] == pcm[:FRAME], axis=1))
    found = [int(starts[i]) for i in first if np.array_equal(stream[starts[i] : starts[i] + pcm.size], pcm)]
    assert len(found) == 1, found
    return found[0] - onset(stream), found[0] + pcm.size - onset(stream)


async def aiortc_decoded(audio: StudentAudio, wav) -> tuple[RTCPeerConnection, RTCPeerConnection]:  # noqa: ANN001
    """An aiortc student and a peer that receives it as the server did before issue 13: frames
    from aiortc's decoder thread through the track, into StudentAudio.push_frame."""
    server, client = RTCPeerConnection(RTCConfiguration(iceServers=[])), RTCPeerConnection(RTCConfiguration(iceServers=[]))

    async def pump(track) -> None:  # noqa: ANN001
        try:
            while True:
                audio.push_frame(await track.recv())
        except MediaStreamError:
            audio.close()

    server.on("track", lambda track: asyncio.ensure_future(pump(track)))
    client.addTrack(MediaPlayer(str(wav), loop=False).audio)
    await client.setLocalDescription(await client.createOffer())
    await server.setRemoteDescription(client.localDescription)
    await server.setLocalDescription(await server.createAnswer())
    await client.setRemoteDescription(server.localDescription)
    return server, client


def fed_to_vad(monkeypatch) -> dict[str, list[np.ndarray]]:  # noqa: ANN001 - pytest's
    """From now on, each student's live audio as its VAD gets it, by student name."""
    streams: dict[str, list[np.ndarray]] = defaultdict(list)
    push = StudentAudio.push_pcm16

    def recorded(self: StudentAudio, samples: np.ndarray) -> None:
        streams[self.student_name].append(np.array(samples, np.int16))
        push(self, samples)

    monkeypatch.setattr(StudentAudio, "push_pcm16", recorded)
    return streams


@contextlib.asynccontextmanager
async def serving(engine, admin: str, cut: dict[str, list], on_cut: Callable[[Utterance], None] = lambda u: None,
                  ) -> AsyncIterator[tuple[str, Classroom]]:  # noqa: ANN001 - an Engine
    """`serve` in this process (its URL, its Classroom); every utterance its VAD cuts is noted
    in cut[student name] (and given to on_cut) on its way to recognition."""
    app, classroom = serve_app(Settings(admin_token=admin, ice_hosts=["127.0.0.1"]), engine, None)
    submit = classroom.sink.submit

    def keep(utterance: Utterance) -> None:
        cut[utterance.student_name].append(utterance)
        on_cut(utterance)
        submit(utterance)

    classroom.sink.submit = keep  # type: ignore[method-assign]
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), classroom
    finally:
        await server.close()


def opus_as_aiortc_sends(pcm: np.ndarray) -> list[bytes]:
    """The packets an aiortc student sends for this audio: aiortc's own encoder (48 kHz stereo,
    96 kb/s, VoIP), fed as its MediaPlayer feeds it."""
    encoder, packets = OpusEncoder(), []
    for i in range(0, pcm.size, 1024):
        frame = av.AudioFrame.from_ndarray(pcm[None, i : i + 1024].copy(), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, i, Fraction(1, RATE)
        packets += encoder.encode(frame)[0]
    return packets


async def over_ws(session: aiohttp.ClientSession, url: str, room: dict, name: str, messages: list[bytes],
                  fmt: str) -> None:
    """One message every 20 ms (as a microphone would), then hang up."""
    query = f"token={token_of(room['student_url'])}&name={name}"
    async with session.ws_connect(url.replace("http", "ws") + "/ws/ingest?" + query) as ws:
        await ws.receive_json(timeout=10)
        await ws.send_json({"format": fmt})
        assert (await ws.receive_json(timeout=10))["format"] == fmt
        start = time.monotonic()
        for i, message in enumerate(messages):
            await ws.send_bytes(message)
            await asyncio.sleep(max(0.0, start + (i + 1) * 0.02 - time.monotonic()))


def test_webrtc_and_ws_ingest_cut_the_same_utterances(tiny_engine, librivox, tmp_path, monkeypatch):
    clips = [librivox[1], librivox[4]]  # 3.0 s and 3.3 s: two utterances
    gap = np.zeros(int(1.5 * RATE), np.float32)
    speech = np.concatenate([clips[0][1], gap, clips[1][1]])
    wav = speech_file(tmp_path / "speech.wav", speech)  # 1 s before, 1.5 s after
    pcm = (np.clip(np.concatenate([np.zeros(RATE, np.float32), speech, np.zeros(int(1.5 * RATE), np.float32)]), -1, 1)
           * 32767).astype(np.int16)  # the same samples as the file

    streams = fed_to_vad(monkeypatch)  # what each student's VAD was fed
    cut: dict[str, list] = defaultdict(list)

    async def body() -> tuple[list[dict], dict[str, np.ndarray]]:
        async with serving(tiny_engine, ADMIN, cut) as (url, classroom):
            async with aiohttp.ClientSession() as s:
                room = await create_room(s, url, ADMIN, "same")
                dashboard = await Dashboard().open(s, url, room)
                student = await join_student(s, url, room, "webrtc", wav)
                before = classroom.student_audio(classroom.rooms.rooms[room["room_id"]], "before", "before")
                peers = await aiortc_decoded(before, wav)
                await asyncio.gather(
                    over_ws(s, url, room, "ws-pcm16", [pcm[i : i + 320].astype("<i2").tobytes() for i in range(0, pcm.size, 320)],
                            "pcm16"),
                    over_ws(s, url, room, "ws-opus", opus_as_aiortc_sends(pcm), "opus"),
                )
                for pc in (student, *peers):  # each file has played to its end
                    while pc.getSenders() and pc.getSenders()[0].track and pc.getSenders()[0].track.readyState == "live":
                        await asyncio.sleep(0.1)
                await asyncio.sleep(0.5)
                for pc in (student, *peers):
                    await pc.close()
                for _ in range(600):
                    if len(dashboard.transcripts()) >= sum(len(u) for u in cut.values()) >= 8:
                        break
                    await asyncio.sleep(0.1)
                await dashboard.close()
                return dashboard.transcripts(), {name: np.concatenate(chunks) for name, chunks in streams.items()}

    transcripts, fed = asyncio.run(asyncio.wait_for(body(), 120))
    assert sorted(cut) == ["before", "webrtc", "ws-opus", "ws-pcm16"] and all(len(cut[name]) == 2 for name in cut), \
        {name: len(u) for name, u in cut.items()}
    cuts = {name: [boundaries(fed[name], u.audio) for u in cut[name]] for name in cut}
    text = {name: [t["text"] for t in sorted((t for t in transcripts if t["student_name"] == name), key=lambda t: t["start_ts"])]
            for name in cut}
    print(cuts, text)

    def within(name: str, other: str, frames: int = 1, ends: int = 1) -> bool:
        return all(abs(a - b) <= frames * FRAME and abs(c - d) <= ends * FRAME
                   for (a, c), (b, d) in zip(cuts[name], cuts[other]))

    # The same Opus packets over WebRTC (decoded at 16 kHz in the event loop), over the ingest
    # (FFmpeg's decoder at 48 kHz, resampled) and over WebRTC as decoded before: the same cuts.
    assert within("webrtc", "ws-opus") and within("webrtc", "before"), cuts
    assert text["webrtc"] == text["ws-opus"] == text["before"] == text["ws-pcm16"], text
    assert all(len(t.split()) >= 5 for t in text["ws-pcm16"]), text
    # Raw PCM16: Opus's VoIP high-pass filter takes this recording's hum (below 100 Hz, 20 dB) out
    # of the frames' level, which the VAD compares with the tracked noise floor, so where a
    # word fades out the last frames can fall on either side of it: the starts agree within a
    # frame, an end within three (the second clip's ends 71 ms apart, the same before and after).
    assert within("webrtc", "ws-pcm16", frames=1, ends=3), cuts
