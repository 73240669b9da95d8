"""A student's join, reconnect and leave, whatever the transport; and the parts of one server
process that work beside the data path (stages.py), made and started here.

Join: a seat (rooms/seats.py), unless the room or the server is full (Busy: capacity.py), and a
StudentAudio wired to the utterance sink. Reconnect: the same identity replaces its old
connection and keeps its seat. Leave: the stream's last speech is flushed (or parked for a page
that keeps its audio: rooms/parking.py), and the seat goes after the grace period.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Protocol

from streamserver.audio.pacing import Pacer
from streamserver.audio.pipeline import StudentAudio
from streamserver.audio.segmenter import SegmenterConfig
from streamserver.bus import Bus
from streamserver.bus.local import LocalFeeds
from streamserver.bus.ordered import OrderedPublisher
from streamserver.capacity import Capacity
from streamserver.config import Settings
from streamserver.events import StudentEvent
from streamserver.heap import give_back_freed_memory
from streamserver.loop_lag import LoopLag
from streamserver.metrics import Metrics
from streamserver.queue.base import UNREACHABLE
from streamserver.queue.sink import Busy, UtteranceSink
from streamserver.rooms.acks import Acks
from streamserver.rooms.admission import Admission, AddressLimits
from streamserver.rooms.connections import Connection, Connections, End, Tell
from streamserver.rooms.directory import RoomDirectory
from streamserver.rooms.feed import DashboardFeed
from streamserver.rooms.parking import Parking
from streamserver.rooms.registry import Room, RoomRegistry
from streamserver.rooms.seats import SeatKeeper
from streamserver.rooms.upkeep import RoomUpkeep
from streamserver.tasks import Tasks
from streamserver.transport import webrtc
from streamserver.transport.candidates import CandidatePolicy
from streamserver.transport.ws_ingest import CLOSE_REPLACED


class Background(Protocol):
    """A part that runs beside the server (the in-process ASR worker of `serve`)."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...


class Classroom:
    def __init__(self, settings: Settings, bus: Bus, sink: UtteranceSink, publisher: OrderedPublisher,
                 metrics: Metrics, background: tuple[Background, ...] = (), local: LocalFeeds | None = None) -> None:
        self.settings, self.bus, self.sink, self.publisher, self.metrics = settings, bus, sink, publisher, metrics
        self.background = background
        self.local = local or LocalFeeds()  # this process's own events (a gateway's fallback): bus/local.py
        self.rooms = RoomRegistry(settings.max_students)
        self.directory = RoomDirectory(self.rooms, bus, settings.room_idle_ttl_s, settings.token_ttl_s)
        self.seats = SeatKeeper(bus, self.rooms, settings.seat_lease_s)
        self.admission = Admission()
        self.connections = Connections()
        metrics.streams_per_room = self.connections.per_room
        self.upkeep = RoomUpkeep(self.rooms, self.directory, self.seats, self.connections, publisher,
                                 self.admission, settings.room_idle_ttl_s)
        self.parking = Parking(sink.queue, bus, settings.leave_grace_s)
        self.loop_lag = LoopLag(metrics.loop_lag.observe)
        self._joining = 0  # students on their way in: past their capacity check, not yet connected
        self.capacity = Capacity(sink, self.loop_lag, lambda: len(self.connections) + self._joining,
                                 settings.expected_speaking, settings.gateway_name)
        self.segmenter_config = replace(SegmenterConfig.with_hangover(settings.vad_hangover_ms),
                                        partial_interval_ms=settings.partial_interval_ms if settings.partials != "off" else 0)
        webrtc.use_host_addresses(settings.ice_hosts)
        self.candidates = CandidatePolicy.of(settings.ice_allow, settings.ice_hosts)
        self.tasks = Tasks()  # what runs beside the streams (and the app's own: api/app.py)

    async def start(self) -> None:
        for part in self.background:
            part.start()
        self.sink.start()
        self.seats.start()
        for work in (self.sink.watch_depth(), self.upkeep.run(), self.loop_lag.run(),
                     Acks(self.connections, self.sink).run(), self.capacity.run(),
                     give_back_freed_memory(lambda: _held(self.connections, self.sink))):
            self.tasks.spawn(work)

    async def stop(self) -> None:
        self.capacity.stopped = True
        self.tasks.cancel()
        for connection in list(self.connections.values()):
            await connection.end("the server is shutting down", 1001)
        await self.seats.stop()
        for part in self.background:
            await part.stop()
        await self.sink.stop()
        await self.bus.close()

    def feed(self, room_id: str) -> DashboardFeed:
        """A dashboard's feed of the room (rooms/feed.py), counted while open (rooms/upkeep.py)."""
        return DashboardFeed(room_id, self.bus, self.local, self.upkeep.feeds, self.sink.fallback is not None, self.settings.seat_lease_s)

    @property
    def transcripts(self) -> str | None:
        """On a gateway with a fallback model: where its transcripts come from now."""
        return None if self.sink.fallback is None else "central" if self.local.central else "local fallback"

    async def open_stream(self, room: Room, student_id: str, name: str, address: str, end: End,
                          limits: AddressLimits = AddressLimits(), tell: Tell | None = None,
                          catch_up: bool = False, resumed: bool = False, source: str = "") -> StudentAudio:
        """A student's audio over a transport the caller owns (WebSocket ingest: `end` closes it, `tell`
        messages its client), fed 16 kHz PCM until close_stream. Raises RoomFull, Busy, TooManyFromAddress, BusError."""
        audio, new = await self.join(room, student_id, name, address, limits, catch_up, resumed, source)
        await self.joined(room, student_id, Connection(end, audio, address, tell), new)
        return audio

    async def join(self, room: Room, student_id: str, name: str, address: str, limits: AddressLimits,
                   catch_up: bool = False, resumed: bool = False, source: str = "") -> tuple[StudentAudio, bool]:
        """Seat a student, whatever the transport: its new pipeline, and whether it is new to the
        room; counted as joining until joined() or not_joined(). A reconnect replaces its old
        connection and keeps its seat, even in a full room or a busy server (a seated student is
        never dropped to make room; one that proves its identity and brings audio back may have
        been seated by a gateway that is gone). `source`: whose share of the room's queue its
        utterances count in (tokens.Claim.queue_source; its address by default)."""
        key = (room.room_id, student_id)
        self.admission.check(room.room_id, address, limits, self.connections.from_address(room.room_id, address, student_id))
        seated = student_id in room.students
        self._joining += 1
        try:
            if not (seated or key in self.connections or (catch_up and resumed)) and (why := await self.capacity.refuse(room.room_id)):
                self.metrics.busy_rejections.inc()
                raise Busy(why)
            await self.seats.take(room, student_id, name)
        except BaseException:
            self._joining -= 1
            raise
        try:
            _, new = self.rooms.join(room, student_id, name)
            old = self.connections.pop(key, None)
            for gone in (old.audio if old else None, self.parking.take(*key)):
                if gone is not None:
                    gone.close(flush=not catch_up)  # catching up: the page sends its speech again
            if old:
                await old.end("replaced by a newer connection of this student", CLOSE_REPLACED)
            return self.student_audio(room, student_id, name, source=source or address), new
        except BaseException:
            await self.not_joined(room, student_id, not seated)
            raise

    async def joined(self, room: Room, student_id: str, connection: Connection, new: bool) -> None:
        self.connections[(room.room_id, student_id)] = connection
        self._joining -= 1
        self.capacity.joined()
        if new:
            await self._event(room, student_id, "student_joined")

    async def not_joined(self, room: Room, student_id: str, new: bool) -> None:
        """A join that failed after join(): a new student's seat goes back at once (it was never
        announced); a reconnect's after the grace period, unless it comes back."""
        self._joining -= 1
        if new:
            await self.seats.unseat(room, student_id)
        elif (room.room_id, student_id) not in self.connections:
            self._leave_soon(room, student_id)

    def is_current(self, room: Room, student_id: str, audio: StudentAudio) -> bool:
        return self.connections.is_current(room.room_id, student_id, audio)

    def close_stream(self, room: Room, student_id: str, audio: StudentAudio) -> None:
        """The stream ended: its last speech flushed (parked, for a page that keeps its audio and
        left without a goodbye); if still the student's (not replaced), it leaves after the grace period."""
        if audio.kept and not audio.said_bye and not audio.closed:
            self.parking.park(audio)
        elif not audio.closed:
            audio.close()
        if self.is_current(room, student_id, audio):
            del self.connections[(room.room_id, student_id)]
            self._leave_soon(room, student_id)

    def _leave_soon(self, room: Room, student_id: str) -> None:
        async def leave() -> None:  # a page back within the grace period keeps its seat, unannounced
            await asyncio.sleep(self.settings.leave_grace_s)
            if (room.room_id, student_id) not in self.connections and (student := await self.seats.unseat(room, student_id)):
                await self.publisher.publish(StudentEvent(room.room_id, student_id, student.name, "student_left"))

        self.tasks.spawn(leave())

    async def _event(self, room: Room, student_id: str, kind: str) -> None:
        if student := room.students.get(student_id):
            student.speaking = kind == "speaking_started" or (student.speaking and kind != "speaking_stopped")
            await self.publisher.publish(StudentEvent(room.room_id, student_id, student.name, kind))

    def student_audio(self, room: Room, student_id: str, name: str, pacer: Pacer | None = None,
                      source: str = "") -> StudentAudio:
        """A student's pipeline: paced, VAD with this server's settings, to the sink."""
        return StudentAudio(room.room_id, student_id, name, room.language, self.sink,
                            lambda speaking: self.tasks.spawn(self._event(room, student_id, "speaking_started" if speaking else "speaking_stopped")),
                            self.segmenter_config, pacer or self.pacer(), source=source)

    def pacer(self) -> Pacer:
        """A stream's pace limit (audio/pacing.py) at this server's rate; its refusals counted."""
        return Pacer(self.settings.max_audio_rate, on_refused=self.metrics.paced_refusals.inc)


async def _held(connections: Connections, sink: UtteranceSink) -> int:
    """What holds memory in a server process: the streams, and the utterances waiting for recognition."""
    try:
        return len(connections) + await sink.depth()
    except UNREACHABLE:  # the queue is away: the streams alone
        return len(connections)
