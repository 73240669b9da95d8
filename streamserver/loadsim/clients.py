"""Simulated students and teachers: real aiortc peers playing real speech files, and a dashboard
client on the feed WebSocket. Used by the tests and the live-latency benchmark."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
import wave
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import aiohttp
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.contrib.media import MediaPlayer
from aiortc.mediastreams import MediaStreamTrack

from engines.features import SAMPLE_RATE
# The protocol's requests are the client's (streamserver/client.py); the simulator adds its load.
from streamserver.client import admin_headers, feed_url, link_param, token_of  # noqa: F401 - link_param: re-exported
from streamserver.loadsim.config import LoadConfig
from streamserver.transport.dtx import asks_for_dtx
from streamserver.transport.webrtc import use_host_addresses

# A feed event, the client clock when it arrived, and whether it is a replay of the room's history.
OnEvent = Callable[[dict, float, bool], None]


class JoinRefused(AssertionError):
    """The server turned a student away (an AssertionError, as the tests have always expected)."""

    def __init__(self, status: int, message: str, retry_after: str | None = None) -> None:
        super().__init__(f"{status} {message}")
        self.status = status
        self.busy = status == 503 or '"busy"' in message  # the workers are full, not the room
        try:  # seconds (the HTTP-date form is not sent by this server)
            self.retry_after_s = max(0.0, float(retry_after)) if retry_after else 0.0
        except ValueError:
            self.retry_after_s = 0.0


def next_url(urls: list[str], url: str) -> str:
    """The server after `url` in a run's list (its first for one not in it): where a student or a
    dashboard whose server is gone tries next."""
    return urls[(urls.index(url) + 1) % len(urls)] if url in urls else urls[0]


def speech_file(path: Path, audio: np.ndarray, lead_s: float = 1.0, tail_s: float = 1.5) -> Path:
    """A 16 kHz wav with silence around the speech: audio before the connection is up is lost,
    and the tail lets the VAD's hangover close the utterance before the track ends."""
    pad = lambda s: np.zeros(int(s * SAMPLE_RATE), np.float32)  # noqa: E731
    pcm = (np.clip(np.concatenate([pad(lead_s), audio, pad(tail_s)]), -1, 1) * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm.tobytes())
    return path


async def create_room(
    session: aiohttp.ClientSession, url: str, admin_token: str, name: str = "class",
    language: str = LoadConfig.language, max_students: int | None = None,
) -> dict:
    """A room (sized for `max_students`, else the server's default size)."""
    body: dict = {"name": name, "language": language}
    if max_students is not None:
        body["max_students"] = max_students
    async with session.post(f"{url}/api/rooms", json=body, headers=admin_headers(admin_token)) as r:
        assert r.status == 201, await r.text()
        return await r.json()


async def join_student(
    session: aiohttp.ClientSession, url: str, room: dict, name: str, wav: Path | MediaStreamTrack,
    identity: dict[str, str] | None = None, recovery_channel: bool = False, dtx: bool = True,
    source: str | None = None,
) -> RTCPeerConnection:
    """An aiortc student that plays `wav` as its microphone, once (aiortc's MediaPlayer: it
    encodes for this student), or sends what an audio track gives (webrtc_student.OpusPlanTrack:
    packets encoded once per clip, with DTX when the server's answer asks for it). The identity
    the server issued is left on the peer as `pc.identity` (student_id and resume secret, also
    `pc.student_id`); pass it back to reconnect as the same student. `recovery_channel`: it opens the student page's recovery data
    channel and sends its marks, so that the server pays for it as for a page (acks come back;
    this student keeps no audio: it never catches up). `dtx` False: DTX is never used (a noisy
    room, where the encoder never goes quiet). `source`: the address the offer comes from (one of
    its own per student, as students joining from their homes: loopback_source())."""
    use_host_addresses(["127.0.0.1"])
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    track = wav if isinstance(wav, MediaStreamTrack) else MediaPlayer(str(wav), loop=False).audio
    pc.addTrack(track)
    if hasattr(track, "bind"):  # pre-encoded packets: sent by the track itself (webrtc_student.FastRtp)
        track.bind(pc)
    if recovery_channel:
        _page_marks(pc)
    await pc.setLocalDescription(await pc.createOffer())  # aiortc gathers all candidates here
    body = {"token": token_of(room["student_url"]), "sdp": pc.localDescription.sdp, "type": "offer", "student_name": name}
    body.update(identity or {})
    if recovery_channel:
        body["recovery"] = {"catch_up": False}
    try:
        answer = await _offer(session, f"{url}/api/rooms/{room['room_id']}/offer", body, source)
    except BaseException:
        await pc.close()
        raise
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
    if dtx and hasattr(track, "use_dtx") and asks_for_dtx(answer["sdp"]):  # as a browser's encoder does
        track.use_dtx()
    pc.student_id = answer["student_id"]  # type: ignore[attr-defined]
    pc.identity = {"student_id": answer["student_id"], "resume": answer["resume"]}  # type: ignore[attr-defined]
    return pc


async def _offer(session: aiohttp.ClientSession, url: str, body: dict, source: str | None) -> dict:
    """The server's answer to an offer (JoinRefused when it refuses), sent from `source`."""
    own = None
    if source is not None:
        own = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(source, 0)), timeout=session.timeout)
    try:
        async with (own or session).post(url, json=body) as r:
            if r.status != 200:
                raise JoinRefused(r.status, await r.text(), r.headers.get("Retry-After"))
            return await r.json()
    finally:
        if own is not None:
            await own.close()


def loopback_source(url: str, index: int) -> str | None:
    """An address of its own for student `index` when the server is on this machine (127.0.0.0/8
    is all loopback on Linux): a server counts WebRTC offers per client address
    (rooms/offers.py), and a class joins from as many homes as it has students, not from one.
    None for a server elsewhere."""
    if urlsplit(url).hostname not in ("127.0.0.1", "localhost") or sys.platform != "linux":
        return None
    return f"127.1.{index // 250 % 250}.{index % 250 + 1}"


def _page_marks(pc: RTCPeerConnection) -> None:
    """The student page's recovery channel traffic (web_demo/student.js): marks on its own clock,
    8 at 250 ms and then one every 5 s; the server's acks are read and dropped."""
    channel = pc.createDataChannel("recovery")
    began = time.monotonic()

    async def marks() -> None:
        for n in itertools.count():
            if channel.readyState == "closed" or pc.connectionState in ("failed", "closed"):
                return
            if channel.readyState == "open":
                channel.send(json.dumps({"type": "mark", "t": round(time.monotonic() - began, 3)}))
            await asyncio.sleep(0.25 if n < 8 else 5.0)

    @channel.on("open")
    def _open() -> None:
        pc._marks = asyncio.ensure_future(marks())  # type: ignore[attr-defined] - kept with the peer


class Dashboard:
    """A teacher's feed: collects every event it receives (and hands each to `on_event`)."""

    def __init__(self, on_event: OnEvent | None = None) -> None:
        self.events: list[dict] = []
        self.history: list[dict] = []
        self._on_event = on_event
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self._task: asyncio.Task | None = None

    async def open(self, session: aiohttp.ClientSession, url: str, room: dict) -> "Dashboard":
        self.ws = await session.ws_connect(feed_url(url, room["room_id"], token_of(room["teacher_url"])))
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.ws is not None
        async for message in self.ws:
            event = json.loads(message.data)
            received = time.time()
            if event["type"] == "history":  # what happened before we were subscribed counts too
                self.history = event["events"]
                self.events.extend(self.history)
                for old in self.history if self._on_event else ():
                    self._on_event(old, received, True)
            self.events.append(event)
            if self._on_event:
                self._on_event(event, received, False)

    async def closed(self) -> None:
        """Returns when the server closed the feed (or it failed)."""
        if self._task:
            await asyncio.gather(self._task, return_exceptions=True)

    def transcripts(self) -> list[dict]:
        return [e for e in self.events if e["type"] == "transcript"]

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._task:
            await asyncio.gather(self._task, return_exceptions=True)
