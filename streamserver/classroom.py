"""The server's state and the glue of the data path:
transport (WebRTC peer) -> audio (StudentAudio) -> asr (AsrWorker) -> bus -> room feed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass

from aiortc import RTCPeerConnection

from engines.engine import Engine
from streamserver.asr.worker import AsrWorker
from streamserver.metrics import Counter, Gauge, Registry
from streamserver.audio.pipeline import StudentAudio
from streamserver.audio.segmenter import SegmenterConfig
from streamserver.bus import Bus
from streamserver.config import Settings
from streamserver.events import StudentEvent, TranscriptEvent
from streamserver.intent import IntentClassifier
from streamserver.queue.sink import Busy, QueueSink
from streamserver.rooms.registry import Room, RoomFull, RoomRegistry, Student
from streamserver.transport import webrtc

log = logging.getLogger(__name__)


@dataclass
class Connection:
    pc: RTCPeerConnection | StreamPeer
    audio: StudentAudio


class Classroom:
    def __init__(
        self, settings: Settings, engine: Engine | None, bus: Bus, intent: IntentClassifier | None = None,
        sink: QueueSink | None = None,
    ) -> None:
        """engine: transcribe in this process (serve); or sink: hand utterances to worker
        processes through the job queue (gateway)."""
        self.settings = settings
        self.engine = engine
        self.bus = bus
        self.rooms = RoomRegistry(settings.max_students)
        # Seats are leases on the bus, so a room's limit holds across every gateway; this
        # process holds (and renews) the seats of the students in self.rooms under this name.
        self.seat_holder = secrets.token_hex(8)
        if sink is None:
            assert engine is not None, "a classroom needs an engine or a job queue"
            self.worker: AsrWorker | QueueSink = AsrWorker(engine, self._publish_transcript, settings.max_batch, intent)
        else:
            self.worker = sink
        self.connections: dict[tuple[str, str], Connection] = {}
        self.segmenter_config = SegmenterConfig.with_hangover(settings.vad_hangover_ms)
        webrtc.use_host_addresses(settings.ice_hosts)
        self.metrics = Registry()
        self.queue_depth = self.metrics.add(Gauge("streamserver_queue_depth", "utterances waiting for or in transcription"))
        self.metrics.add(Gauge("streamserver_active_streams", "student audio streams per room", read=self._streams_per_room))
        self.busy_answers = self.metrics.add(Counter("streamserver_busy_rejections_total", "joins turned away as busy"))
        self._depth_task: asyncio.Task | None = None
        self._seat_task: asyncio.Task | None = None
        self._publish_locks: dict[str, asyncio.Lock] = {}

    async def start(self) -> None:
        self.worker.start()
        loop = asyncio.get_running_loop()
        self._depth_task = loop.create_task(self._watch_depth())
        self._seat_task = loop.create_task(self._renew_seats())

    async def _watch_depth(self) -> None:
        while True:
            try:
                depth = await self.worker.queue.depth() if isinstance(self.worker, QueueSink) else self.worker.queue.qsize()
                self.queue_depth.set(float(depth))
            except Exception:  # noqa: BLE001 - Redis away: the gauge keeps its last value
                pass
            await asyncio.sleep(1.0)

    async def _renew_seats(self) -> None:
        """Every third of a lease, extend the seats of the students seated here (one bus call for
        every room); a gateway that dies stops doing so, and its seats expire within a lease."""
        lease = self.settings.seat_lease_s
        while True:
            await asyncio.sleep(lease / 3)
            held = {room_id: list(room.students) for room_id, room in self.rooms.rooms.items() if room.students}
            if not held:
                continue
            try:
                await self.bus.renew_seats(held, lease, self.seat_holder)
            except Exception as error:  # noqa: BLE001 - the bus is away: try again next round
                log.warning("could not renew the seats of %d students (%s)", sum(map(len, held.values())), error)
                continue
            # A student who left while the renewal was on its way may have been released before
            # it arrived: release again, now that it has.
            for room_id, students in held.items():
                room = self.rooms.rooms[room_id]
                for student_id in students:
                    if student_id not in room.students:
                        await self._free_seat(room_id, student_id)

    async def _free_seat(self, room_id: str, student_id: str) -> None:
        """Release a seat no longer renewed here; when the bus fails, its lease frees it."""
        try:
            await self.bus.release_seat(room_id, student_id, self.seat_holder)
        except Exception as error:  # noqa: BLE001
            log.warning("seat of %s in room %s not released (%s): it expires with its lease", student_id, room_id, error)

    async def _unseat(self, room: Room, student_id: str) -> Student | None:
        """The student leaves the room here and gives up the seat."""
        student = self.rooms.leave(room, student_id)
        await self._free_seat(room.room_id, student_id)
        return student

    def _streams_per_room(self) -> dict:
        counts: dict[str, int] = {}
        for room_id, _student in self.connections:
            counts[room_id] = counts.get(room_id, 0) + 1
        return {(("room", room_id),): float(n) for room_id, n in counts.items()}

    async def create_room(self, name: str, language: str) -> Room:
        """A new room, announced on the bus so that every gateway of the deployment can seat its
        students and feed its teacher."""
        room = self.rooms.create(name, language)
        # The limit travels with the room: every gateway seats against the creator's.
        await self.bus.save_room(room.room_id, {"name": name, "language": language, "max_students": str(room.max_students)})
        return room

    async def find_room(self, room_id: str) -> Room | None:
        """This process's room, or one another gateway created (read once from the bus)."""
        room = self.rooms.get(room_id)
        if room is None and (meta := await self.bus.load_room(room_id)):
            limit = meta.get("max_students", "")
            room = self.rooms.adopt(
                room_id, meta.get("name", ""), meta.get("language", "auto"), int(limit) if limit.isdigit() else None
            )
        return room

    async def check_capacity(self) -> None:
        """Raise Busy when the ASR workers cannot take one more student (gateway mode)."""
        if isinstance(self.worker, QueueSink) and (reason := await self.worker.busy()):
            self.busy_answers.inc()
            raise Busy(reason)

    async def stop(self) -> None:
        for task in (self._depth_task, self._seat_task):
            if task:
                task.cancel()
        for connection in list(self.connections.values()):
            await connection.pc.close()
        # Free this gateway's seats now rather than when their leases run out.
        seated = [(room.room_id, s) for room in self.rooms.rooms.values() for s in room.students]
        if seated:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(self._free_seat(r, s) for r, s in seated)), 5)
        await self.worker.stop()
        await self.bus.close()

    async def connect_student(self, room: Room, student_id: str, name: str, offer_sdp: str) -> str:
        """Answer a student's offer; a reconnect replaces the old peer and keeps the identity."""
        audio, new = await self._seat(room, student_id, name)
        key = (room.room_id, student_id)
        try:
            pc, answer_sdp = await webrtc.answer(
                offer_sdp, self.settings.ice_servers, audio.push_frame, lambda: self._ended(room, student_id, audio)
            )
        except BaseException:
            if new:  # never announced: the seat goes back at once
                await self._unseat(room, student_id)
            elif key not in self.connections:  # a reconnect whose old peer is already closed
                asyncio.get_running_loop().create_task(self._left(room, student_id))
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
        await asyncio.sleep(self.settings.leave_grace_s)
        if (room.room_id, student_id) not in self.connections:
            student = await self._unseat(room, student_id)
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
        """A bus outage loses this event's live delivery (logged), never the server. A room's
        events leave in the order they were made: speaking_started and _stopped are published from
        tasks made back to back, and two publishes on the connection pool can overtake each other
        (a dashboard then showed a student speaking who had stopped). asyncio.Lock is FIFO."""
        lock = self._publish_locks.setdefault(room_id, asyncio.Lock())
        async with lock:
            try:
                await self.bus.publish(room_id, event_json)
            except Exception:
                log.exception("could not publish to room %s", room_id)

    async def open_stream(self, room: Room, student_id: str, name: str) -> StudentAudio:
        """A student's audio over a transport the caller owns (WebSocket ingest): the same pipeline,
        roster and events as connect_student. A reconnect replaces the old stream or peer; the
        caller pushes 16 kHz PCM into the returned StudentAudio and calls close_stream at the end.
        Raises RoomFull, Busy or BusError like connect_student."""
        audio, new = await self._seat(room, student_id, name)
        self.connections[(room.room_id, student_id)] = Connection(StreamPeer(), audio)
        if new:
            await self._student_event(room, student_id, "student_joined")
        return audio

    def close_stream(self, room: Room, student_id: str, audio: StudentAudio | None = None) -> None:
        """The stream ended: flush its last utterance and, after the grace period, leave the room.
        With `audio`, only that stream is ended (a stream already replaced by a reconnect is
        flushed but leaves the student's seat to its successor)."""
        current = self.connections.get((room.room_id, student_id))
        audio = audio or (current.audio if current else None)
        if audio is not None:
            self._ended(room, student_id, audio)

    async def _seat(self, room: Room, student_id: str, name: str) -> tuple[StudentAudio, bool]:
        """Seat a student, whatever the transport: a reconnect replaces its old peer or stream and
        keeps the identity. The student's new audio pipeline, and whether it is new to the room.
        The seat is the bus's (the limit holds across gateways; a reconnect through any gateway
        keeps its seat): RoomFull when the room has none left, BusError when the bus fails."""
        key = (room.room_id, student_id)
        if key not in self.connections:  # a reconnect keeps its seat
            await self.check_capacity()
        seated = student_id in room.students  # a reconnect: its seat stays whatever happens here
        if not await self.bus.take_seat(room.room_id, student_id, room.max_students, self.settings.seat_lease_s, self.seat_holder):
            raise RoomFull(f"room is full ({room.max_students} students)")
        try:
            _, new = self.rooms.join(room, student_id, name)
            old = self.connections.pop(key, None)
            if old:
                old.audio.close()
                await old.pc.close()
            return self.student_audio(room, student_id, name), new
        except BaseException:
            if not seated:
                await self._unseat(room, student_id)
            raise

    def student_audio(self, room: Room, student_id: str, name: str) -> StudentAudio:
        """A student's audio pipeline (VAD with this server's settings), wired to the worker and
        the room's speaking events; called on the event loop."""
        loop = asyncio.get_running_loop()
        return StudentAudio(
            room.room_id, student_id, name, room.language,
            on_utterance=self.worker.submit,
            on_speaking=lambda speaking: loop.create_task(self._speaking(room, student_id, speaking)),
            config=self.segmenter_config,
        )


class StreamPeer:
    """The peer of a stream opened with open_stream: its transport belongs to the caller, so
    there is nothing to close here (a replaced WebSocket notices and closes itself)."""

    async def close(self) -> None:
        return None
