"""Simulated students and teachers: real aiortc peers playing real speech files, and a dashboard
client on the feed WebSocket. Used by the tests and the live-latency benchmark."""

from __future__ import annotations

import asyncio
import json
import wave
from pathlib import Path

import aiohttp
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.contrib.media import MediaPlayer

from streamserver.transport.webrtc import use_host_addresses

def admin_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def speech_file(path: Path, audio: np.ndarray, lead_s: float = 1.0, tail_s: float = 1.5) -> Path:
    """A 16 kHz wav with silence around the speech: audio before the connection is up is lost,
    and the tail lets the VAD's hangover close the utterance before the track ends."""
    pad = lambda s: np.zeros(int(s * 16000), np.float32)  # noqa: E731
    pcm = (np.clip(np.concatenate([pad(lead_s), audio, pad(tail_s)]), -1, 1) * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return path


async def create_room(
    session: aiohttp.ClientSession, url: str, admin_token: str, name: str = "class", language: str = "en"
) -> dict:
    async with session.post(f"{url}/api/rooms", json={"name": name, "language": language}, headers=admin_headers(admin_token)) as r:
        assert r.status == 201, await r.text()
        return await r.json()


def token_of(link: str) -> str:
    return link.split("token=")[1]


async def join_student(
    session: aiohttp.ClientSession, url: str, room: dict, name: str, wav: Path, student_id: str | None = None
) -> RTCPeerConnection:
    """An aiortc student that plays `wav` as its microphone, once. The server's id for it is
    left on the peer as `pc.student_id`; pass it back to reconnect as the same student."""
    use_host_addresses(["127.0.0.1"])
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    player = MediaPlayer(str(wav), loop=False)
    pc.addTrack(player.audio)
    await pc.setLocalDescription(await pc.createOffer())  # aiortc gathers all candidates here
    body = {"token": token_of(room["student_url"]), "sdp": pc.localDescription.sdp, "type": "offer", "student_name": name}
    if student_id:
        body["student_id"] = student_id
    async with session.post(f"{url}/api/rooms/{room['room_id']}/offer", json=body) as r:
        assert r.status == 200, f"{r.status} {await r.text()}"
        answer = await r.json()
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
    pc.student_id = answer["student_id"]  # type: ignore[attr-defined]
    return pc


class Dashboard:
    """A teacher's feed: collects every event it receives."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.history: list[dict] = []
        self._task: asyncio.Task | None = None

    async def open(self, session: aiohttp.ClientSession, url: str, room: dict) -> "Dashboard":
        ws_url = url.replace("http", "ws") + f"/api/rooms/{room['room_id']}/feed?token={token_of(room['teacher_url'])}"
        self.ws = await session.ws_connect(ws_url)
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        async for message in self.ws:
            event = json.loads(message.data)
            if event["type"] == "history":  # what happened before we were subscribed counts too
                self.history = event["events"]
                self.events.extend(self.history)
            self.events.append(event)

    def transcripts(self) -> list[dict]:
        return [e for e in self.events if e["type"] == "transcript"]

    async def close(self) -> None:
        await self.ws.close()
        if self._task:
            await asyncio.gather(self._task, return_exceptions=True)
