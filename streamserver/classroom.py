"""The server's state and the glue of the data path:
transport (WebRTC peer) -> audio (StudentAudio) -> asr (AsrWorker) -> bus -> room feed."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiortc import RTCPeerConnection

from engines.engine import Engine
from streamserver.asr.worker import AsrWorker
from streamserver.audio.pipeline import StudentAudio
from streamserver.bus import Bus
from streamserver.config import Settings
from streamserver.events import StudentEvent, TranscriptEvent
from streamserver.intent import IntentClassifier
from streamserver.rooms.registry import Room, RoomRegistry
from streamserver.transport import webrtc

log = logging.getLogger(__name__)


@dataclass
class Connection:
    pc: RTCPeerConnection
    audio: StudentAudio


class Classroom:
    def __init__(self, settings: Settings, engine: Engine, bus: Bus, intent: IntentClassifier | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.bus = bus
        self.rooms = RoomRegistry(settings.max_students)
        self.worker = AsrWorker(engine, self._publish_transcript, settings.max_batch, intent)
        self.connections: dict[tuple[str, str], Connection] = {}
        webrtc.use_host_addresses(settings.ice_hosts)

    async def start(self) -> None:
        self.worker.start()

    async def stop(self) -> None:
        for connection in list(self.connections.values()):
            await connection.pc.close()
        await self.worker.stop()
        await self.bus.close()

    async def connect_student(self, room: Room, student_id: str, name: str, offer_sdp: str) -> str:
        """Answer a student's offer; a reconnect replaces the old peer and keeps the identity."""
        student, new = self.rooms.join(room, student_id, name)
        key = (room.room_id, student_id)
        old = self.connections.pop(key, None)
        if old:
            old.audio.close()
            await old.pc.close()
        loop = asyncio.get_running_loop()
        audio = StudentAudio(
            room.room_id, student_id, name, room.language,
            on_utterance=self.worker.submit,
            on_speaking=lambda speaking: loop.create_task(self._speaking(room, student_id, speaking)),
        )
        try:
            pc, answer_sdp = await webrtc.answer(
                offer_sdp, self.settings.ice_servers, audio.push_frame, lambda: self._ended(room, student_id, audio)
            )
        except webrtc.OfferError:
            if new:
                self.rooms.leave(room, student_id)
            raise
        self.connections[key] = Connection(pc, audio)
        if new:
            await self._student_event(room, student_id, "student_joined")
        return answer_sdp

    def _ended(self, room: Room, student_id: str, audio: StudentAudio) -> None:
        audio.close()
        key = (room.room_id, student_id)
        current = self.connections.get(key)
        if current is not None and current.audio is audio:  # not a peer already replaced by a reconnect
            del self.connections[key]
            asyncio.get_running_loop().create_task(self._left(room, student_id))

    async def _left(self, room: Room, student_id: str) -> None:
        # Grace period: a browser that reconnects within it keeps its seat without a left/joined pair.
        await asyncio.sleep(5.0)
        if (room.room_id, student_id) not in self.connections:
            student = self.rooms.leave(room, student_id)
            if student:
                await self._publish(room.room_id, StudentEvent(room.room_id, student_id, student.name, "student_left").to_json())

    async def _speaking(self, room: Room, student_id: str, speaking: bool) -> None:
        student = room.students.get(student_id)
        if student:
            student.speaking = speaking
            await self._student_event(room, student_id, "speaking_started" if speaking else "speaking_stopped")

    async def _student_event(self, room: Room, student_id: str, kind: str) -> None:
        student = room.students[student_id]
        await self._publish(room.room_id, StudentEvent(room.room_id, student_id, student.name, kind).to_json())

    async def _publish_transcript(self, event: TranscriptEvent) -> None:
        await self._publish(event.room_id, event.to_json())

    async def _publish(self, room_id: str, event_json: str) -> None:
        """A bus outage loses this event's live delivery (logged), never the server."""
        try:
            await self.bus.publish(room_id, event_json)
        except Exception:
            log.exception("could not publish to room %s", room_id)
