"""The wiring of one server process's data path:
transport (WebRTC peer or WebSocket stream) -> StudentAudio (VAD) -> UtteranceSink -> recognition
(in this process or in workers) -> bus -> the room's dashboards.

A Classroom holds the live connections and their students' lifecycle (join, reconnect, leave,
speaking); seats, room lookup, publishing and metrics are the jobs of the parts it wires.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Protocol

from streamserver.audio.pacing import Pacer
from streamserver.audio.pipeline import StudentAudio
from streamserver.audio.segmenter import SegmenterConfig
from streamserver.bus import Bus
from streamserver.bus.local import LocalFeeds
from streamserver.bus.ordered import OrderedPublisher
from streamserver.capacity import Capacity
from streamserver.config import Settings
from streamserver.events import RoomClosedEvent, StudentEvent, now
from streamserver.loop_lag import LoopLag
from streamserver.metrics import Metrics
from streamserver.queue.base import UNREACHABLE, spoken_of
from streamserver.queue.sink import Busy, UtteranceSink
from streamserver.rooms.admission import Admission, AddressLimits
from streamserver.rooms.directory import RoomDirectory
from streamserver.rooms.registry import Room, RoomRegistry
from streamserver.rooms.seats import SeatKeeper
from streamserver.transport import recovery, webrtc
from streamserver.transport.candidates import CandidatePolicy
from streamserver.transport.ws_ingest import CLOSE_REPLACED, CLOSE_ROOM_CLOSED

log = logging.getLogger(__name__)
ROOM_WATCH_S = 2.0  # how soon a room closed through another process ends here
KEEP_EVERY_ROUNDS = 15  # a room in use renews its record every 30 s
PARKED_S = 30.0  # a page that keeps its audio has this long to come back before its last speech is flushed
PEER_TOLD_S = 0.5  # a page's "ended" message has this long to get out before its peer closes
ACKS_LATE_S = 1.5  # a round of acks later than this after the last is logged (clients give up at 2 s)
RECALL_EVENTS = 500  # of the room's history, read for what a catching-up student had published
RECALL_WAIT_S = 2.0  # a catch-up waits this long at most for where its queued utterances lie


class Background(Protocol):
    """A part that runs beside the server (the in-process ASR worker of `serve`)."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...


# Ends a transport from the server's side, telling the client why: a WebSocket close code; a
# WebRTC page on its recovery channel, if one is open, when it was replaced or its room closed.
End = Callable[[str, int], Awaitable[None]]


# A message to a client that keeps its audio (an ack): its recovery data channel (which says
# whether it was open to send it) or its WebSocket.
Tell = Callable[[dict], Awaitable[bool | None]]


@dataclass
class Connection:
    end: End
    audio: StudentAudio
    address: str
    tell: Tell | None = None


async def _sent_together(sends: list[asyncio.Future], timeout_s: float) -> None:
    """Acks go out side by side: one client that reads slowly (its socket's buffer full, a send
    waiting for it to drain) must not hold up the acks of everyone behind it, which would make
    every page of the gateway take the server for gone and reconnect at once. A send still
    waiting after timeout_s is given up; that client gets the next round's."""
    if not sends:
        return
    done, waiting = await asyncio.wait(sends, timeout=timeout_s)
    for send in waiting:
        send.cancel()
    for send in done:
        if not send.cancelled() and send.exception() is not None:  # a client gone this instant: its stream ends anyway
            log.debug("an ack was not sent: %s", send.exception())


class Classroom:
    def __init__(self, settings: Settings, bus: Bus, sink: UtteranceSink, publisher: OrderedPublisher,
                 metrics: Metrics, background: tuple[Background, ...] = (), local: LocalFeeds | None = None) -> None:
        self.settings, self.bus, self.sink, self.publisher = settings, bus, sink, publisher
        self.background = background
        # Events for this process's dashboards only (a gateway's fallback transcripts during an
        # outage of the bus): bus/local.py.
        self.local = local or LocalFeeds()
        self.central = True  # transcripts from the central workers (False: this gateway's fallback)
        self.rooms = RoomRegistry(settings.max_students)
        self.directory = RoomDirectory(self.rooms, bus, settings.room_idle_ttl_s, settings.token_ttl_s)
        self.feeds: dict[str, int] = {}  # room -> dashboards connected here
        self._last_used: dict[str, float] = {}  # room -> monotonic time it last had a student or a feed
        self.seats = SeatKeeper(bus, self.rooms, settings.seat_lease_s)
        self.admission = Admission()
        self.loop_lag = LoopLag(metrics.loop_lag.observe)
        self._joining = 0  # students on their way in: past their capacity check, not yet connected
        self.capacity = Capacity(sink, self.loop_lag, lambda: len(self.connections) + self._joining,
                                 settings.expected_speaking, settings.gateway_name)
        self.connections: dict[tuple[str, str], Connection] = {}
        self.segmenter_config = replace(
            SegmenterConfig.with_hangover(settings.vad_hangover_ms),
            partial_interval_ms=settings.partial_interval_ms if settings.partials != "off" else 0,
        )
        webrtc.use_host_addresses(settings.ice_hosts)
        self.candidates = CandidatePolicy.of(settings.ice_allow, settings.ice_hosts)
        self.metrics = metrics
        metrics.streams_per_room = self._streams_per_room
        self._tasks: list[asyncio.Task] = []
        # Streams of pages that keep their audio, ended without a goodbye (a network break): their
        # speech in progress waits for the page to come back and send it again.
        self._parked: dict[tuple[str, str], StudentAudio] = {}
        self._spawned: set[asyncio.Task] = set()  # tasks started from callbacks (a task needs a reference)

    async def start(self) -> None:
        for part in self.background:
            part.start()
        self.sink.start()
        self.seats.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch_depth()), loop.create_task(self._watch_rooms()),
                       loop.create_task(self.loop_lag.run()), loop.create_task(self._acks()),
                       loop.create_task(self.capacity.run())]

    async def stop(self) -> None:
        self.capacity.stopped = True
        for task in self._tasks:
            task.cancel()
        for connection in list(self.connections.values()):
            await connection.end("the server is shutting down", 1001)
        await self.seats.stop()
        for part in self.background:
            await part.stop()
        await self.sink.stop()
        await self.bus.close()

    def uplink_changed(self, up: bool) -> None:
        """The fallback saw the uplink go or come back: every dashboard here is told (their
        header says where transcripts come from)."""
        self.central = up
        for room_id in list(self.rooms.rooms):
            self.local.publish(room_id, json.dumps({"type": "transcription_source", "room_id": room_id,
                                                    "source": "central" if up else "local"}))

    async def _watch_depth(self) -> None:
        while True:
            try:
                self.metrics.queue_depth.set(float(await self.sink.depth()))
            except Exception:  # noqa: BLE001 - the queue is away: the gauge keeps its last value
                pass
            await asyncio.sleep(1.0)

    async def _acks(self) -> None:
        """Tell every client that keeps its audio how far it is safe (transport/recovery.py). The
        acks are the clients' heartbeat, so they keep their beat whatever else is slow: a round
        never waits for the queue (what it learns of published utterances is read beside it, and
        the next round's acks carry it) nor for the previous round's sends, and the rounds keep
        to the clock rather than adding each round's own time to the period."""
        loop = asyncio.get_running_loop()
        settling: asyncio.Task | None = None
        tick = last = loop.time()
        while True:
            tick = max(tick + recovery.ACK_EVERY_S, loop.time())
            await asyncio.sleep(tick - loop.time())
            if loop.time() - last > ACKS_LATE_S:  # the clients' heartbeat was late: say so, it may cost reconnects
                log.warning("acks went out %.2f s after the last round (%d connections)", loop.time() - last, len(self.connections))
            last = loop.time()
            kept = [c for c in self.connections.values() if c.tell is not None and c.audio.kept]
            if settling is None or settling.done():
                settling = loop.create_task(self._settle(kept))
            ts = now()
            sends = []
            for c in kept:
                if c.audio.closed or self.connections.get((c.audio.room_id, c.audio.student_id)) is not c:
                    continue  # replaced meanwhile: its speech in progress may be the page's to send again
                ack = c.audio.ack()
                sends.append(asyncio.ensure_future(c.tell({"type": "ack", "t": None if ack is None else round(ack, 4), "ts": ts})))
            self.spawn(_sent_together(sends, recovery.ACK_EVERY_S))

    async def _settle(self, kept: list[Connection]) -> None:
        """Learn which of the clients' utterances are published: their audio is safe."""
        try:
            done = await self.sink.settled([uid for c in kept for uid in c.audio.unsettled()])
        except Exception as error:  # noqa: BLE001 - the queue is away or slow: acks stand still, pages keep their audio
            log.debug("acks not advanced: %s", error)
            return
        for c in kept:
            c.audio.settle(done)

    async def _watch_rooms(self) -> None:
        """Rooms in use here keep their record alive and end here when another process closed
        them (or their record is gone); a room nobody used for the idle time is forgotten."""
        rounds = 0
        while True:
            await asyncio.sleep(ROOM_WATCH_S)
            rounds += 1
            now = time.monotonic()
            for room in list(self.rooms.rooms.values()):
                in_use = room.students or self.feeds.get(room.room_id)
                if in_use:
                    self._last_used[room.room_id] = now
                elif now - self._last_used.setdefault(room.room_id, now) > self.settings.room_idle_ttl_s:
                    self._forget(room.room_id)
                    continue
                try:
                    if in_use and rounds % KEEP_EVERY_ROUNDS == 0:
                        await self.directory.keep(room.room_id)
                    if in_use and not await self.directory.is_open(room):
                        await self._end_room(room, "the room was closed")
                except Exception as error:  # noqa: BLE001 - the bus is away: next round
                    log.warning("could not check room %s (%s)", room.room_id, error)

    async def close_room(self, room: Room) -> None:
        """Close the room for good, on every process: students and dashboards are sent away and
        its links answer 403. Raises BusError when the bus cannot record it."""
        await self.directory.close(room.room_id)
        await self.publisher.publish(RoomClosedEvent(room.room_id))
        await self._end_room(room, "the room was closed")

    async def _end_room(self, room: Room, reason: str) -> None:
        self.directory.closed.add(room.room_id)
        for key, connection in [(k, c) for k, c in self.connections.items() if k[0] == room.room_id]:
            del self.connections[key]
            connection.audio.close()
            await connection.end(reason, CLOSE_ROOM_CLOSED)
        for student_id in list(room.students):
            await self.seats.unseat(room, student_id)
        self._forget(room.room_id)

    def _forget(self, room_id: str) -> None:
        self.directory.forget(room_id)
        self.publisher.forget(room_id)
        self.admission.forget(room_id)
        self._last_used.pop(room_id, None)

    def _streams_per_room(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for room_id, _student in self.connections:
            counts[room_id] = counts.get(room_id, 0) + 1
        return counts

    async def check_capacity(self, room: Room) -> None:
        """Raise Busy when this process or recognition cannot take one more student of the room."""
        if reason := await self.capacity.refuse(room.room_id):
            self.metrics.busy_rejections.inc()
            raise Busy(reason)

    async def connect_student(self, room: Room, student_id: str, name: str, offer_sdp: str, address: str,
                              limits: AddressLimits = AddressLimits(), keeps: dict | None = None,
                              resumed: bool = False) -> str:
        """Answer a student's offer; a reconnect replaces the old peer and keeps the identity.
        `keeps`: the page keeps its audio ({"catch_up": bool}: it will send what was not
        acknowledged; transport/recovery.py); `resumed`: it proved its identity (rooms/identity.py)."""
        self._joining += 1
        try:
            return await self._connect_student(room, student_id, name, offer_sdp, address, limits, keeps, resumed)
        finally:
            self._joining -= 1

    async def _connect_student(self, room: Room, student_id: str, name: str, offer_sdp: str, address: str,
                               limits: AddressLimits, keeps: dict | None, resumed: bool) -> str:
        catch_up = bool(keeps and keeps.get("catch_up"))
        audio, new = await self._seat(room, student_id, name, address, limits, catch_up, resumed)
        key = (room.room_id, student_id)
        if keeps is not None:
            audio.keep(catch_up, clock=str(keeps.get("clock") or ""))
            if catch_up:
                audio.already_sent(await self.sent_before(room, student_id, audio.stream_clock))

        def on_channel(channel) -> None:  # noqa: ANN001 - aiortc's RTCDataChannel
            connection = self.connections.get(key)
            if channel.label != recovery.LABEL or not audio.kept or connection is None or connection.audio is not audio:
                channel.close()
                return
            send = recovery.attach(channel, audio, self._catch_up_pacer)

            async def tell(message: dict) -> bool:
                return send(message)

            connection.tell = tell

        try:
            pc, answer_sdp = await webrtc.answer(
                offer_sdp, self.settings.ice_servers, audio.push_pcm16, lambda: self._ended(room, student_id, audio),
                self.candidates, on_channel, lambda: audio.utterance_open,
            )
        except BaseException:
            if new:  # never announced: the seat goes back at once
                await self.seats.unseat(room, student_id)
            elif key not in self.connections:  # a reconnect whose old peer is already closed
                asyncio.get_running_loop().create_task(self._left(room, student_id))
            raise
        connection = Connection(lambda reason, code: self._end_peer(pc, connection, reason, code), audio, address)
        self.connections[key] = connection
        self.capacity.joined()
        if new:
            await self._student_event(room, student_id, "student_joined")
        return answer_sdp

    async def _end_peer(self, pc, connection: Connection, reason: str, code: int) -> None:  # noqa: ANN001 - aiortc's RTCPeerConnection
        """A student's WebRTC peer ended from the server's side. A page told on its recovery
        channel that it was replaced or that its room closed stops there (recovery.py, "ended");
        told nothing, it takes the closed peer for a network break and connects again, and a
        duplicated tab (the same identity: a browser copies a tab's sessionStorage) would take
        the seat back, then the other tab, and so on. The peer closes PEER_TOLD_S later, in the
        background: closed at once, SCTP drops what it has not sent."""
        told = False
        if code in (CLOSE_REPLACED, CLOSE_ROOM_CLOSED) and connection.tell is not None:
            told = bool(await connection.tell({"type": "ended", "code": code, "error": reason}))
        if not told:  # no channel open (a page without one, or not yet): it just closes
            await pc.close()
            return

        async def close_later() -> None:
            await asyncio.sleep(PEER_TOLD_S)
            try:
                await pc.close()
            except Exception:  # noqa: BLE001 - the peer is going anyway; never the room
                log.exception("closing the told peer of student %s failed", connection.audio.student_id)

        self.spawn(close_later())

    async def open_stream(self, room: Room, student_id: str, name: str, address: str, end: End,
                          limits: AddressLimits = AddressLimits(), tell: Tell | None = None,
                          catch_up: bool = False, resumed: bool = False) -> StudentAudio:
        """A student's audio over a transport the caller owns (WebSocket ingest): the same pipeline,
        roster and events as connect_student; `end` closes that transport, `tell` sends its
        client a message (acks, once the client says it keeps its audio: StudentAudio.keep;
        `catch_up`: it starts with audio sent again; `resumed`: as connect_student's). The caller pushes 16 kHz PCM into the
        returned StudentAudio and calls close_stream at the end. Raises RoomFull, Busy,
        TooManyFromAddress or BusError."""
        self._joining += 1
        try:
            audio, new = await self._seat(room, student_id, name, address, limits, catch_up, resumed)
            self.connections[(room.room_id, student_id)] = Connection(end, audio, address, tell)
            self.capacity.joined()
        finally:
            self._joining -= 1
        if new:
            await self._student_event(room, student_id, "student_joined")
        return audio

    def is_current(self, room: Room, student_id: str, audio: StudentAudio) -> bool:
        """Whether `audio` is still the student's stream (not replaced by a reconnect)."""
        connection = self.connections.get((room.room_id, student_id))
        return connection is not None and connection.audio is audio

    def close_stream(self, room: Room, student_id: str, audio: StudentAudio | None = None) -> None:
        """The stream ended: flush its last utterance and, after the grace period, leave the room.
        With `audio`, only that stream is ended (a stream already replaced by a reconnect is
        flushed but leaves the student's seat to its successor)."""
        current = self.connections.get((room.room_id, student_id))
        audio = audio or (current.audio if current else None)
        if audio is not None:
            self._ended(room, student_id, audio)

    def _ended(self, room: Room, student_id: str, audio: StudentAudio) -> None:
        if audio.kept and not audio.said_bye and not audio.closed:
            self._park(room, student_id, audio)
        elif not audio.closed:
            audio.close()
        if self.is_current(room, student_id, audio):  # not a peer already replaced by a reconnect
            del self.connections[(room.room_id, student_id)]
            asyncio.get_running_loop().create_task(self._left(room, student_id))

    def _park(self, room: Room, student_id: str, audio: StudentAudio) -> None:
        """A page that keeps its audio broke off: its speech in progress is dropped if it comes
        back and sends it again (_seat), and flushed after the grace period if it does not."""
        key = (room.room_id, student_id)
        old = self._parked.pop(key, None)
        if old is not None:
            old.close()
        self._parked[key] = audio

        def give_up() -> None:
            if self._parked.get(key) is audio:
                del self._parked[key]
                audio.close()

        asyncio.get_running_loop().call_later(max(PARKED_S, self.settings.leave_grace_s), give_up)

    async def sent_before(self, room: Room, student_id: str, clock: str) -> list[tuple[float, float]]:
        """A page sends audio again: where its utterances already queued or published lie on its
        clock (audio/sent_again.py). None found when the queue does not answer in time: the
        check at publication still keeps a copy out of the room."""
        await self.recall_spoken(room, student_id, clock)
        try:
            return await asyncio.wait_for(self.sink.queue.sent_spans(room.room_id, spoken_of(student_id, clock)), RECALL_WAIT_S)
        except (*UNREACHABLE, TimeoutError) as error:
            log.warning("queued utterances of student %s not read for its catch-up: %s", student_id, error)
            return []

    async def recall_spoken(self, room: Room, student_id: str, clock: str) -> None:
        """A page sends audio again: a queue that keeps no record of its own (a `serve` that
        restarted remembers nothing) learns from the room's history what of it is published."""
        if self.sink.queue.keeps_spoken:
            return
        try:
            history = await self.bus.history(room.room_id, RECALL_EVENTS)
        except Exception as error:  # noqa: BLE001 - the bus is away: the queue's own record decides
            log.warning("history of room %s not read for a catch-up: %s", room.room_id, error)
            return
        spans = []
        for raw in history:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if (event.get("student_id") == student_id and event.get("stream_clock", "") == clock
                    and event.get("stream_start") is not None):
                spans.append((float(event["stream_start"]), float(event["stream_end"]), bool(event.get("recovered"))))
        self.sink.queue.remember_spoken(room.room_id, spoken_of(student_id, clock), spans)

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    def _catch_up_pacer(self) -> Pacer:
        return Pacer(self.settings.max_audio_rate, on_refused=self.metrics.paced_refusals.inc)

    async def _left(self, room: Room, student_id: str) -> None:
        # Grace period: a browser that reconnects within it keeps its seat without a left/joined pair.
        await asyncio.sleep(self.settings.leave_grace_s)
        if (room.room_id, student_id) not in self.connections:
            student = await self.seats.unseat(room, student_id)
            if student:
                await self.publisher.publish(StudentEvent(room.room_id, student_id, student.name, "student_left"))

    async def _speaking(self, room: Room, student_id: str, speaking: bool) -> None:
        student = room.students.get(student_id)
        if student:
            student.speaking = speaking
            await self._student_event(room, student_id, "speaking_started" if speaking else "speaking_stopped")

    async def _student_event(self, room: Room, student_id: str, kind: str) -> None:
        student = room.students[student_id]
        await self.publisher.publish(StudentEvent(room.room_id, student_id, student.name, kind))

    async def _seat(self, room: Room, student_id: str, name: str, address: str,
                    limits: AddressLimits, catch_up: bool = False, resumed: bool = False) -> tuple[StudentAudio, bool]:
        """Seat a student, whatever the transport: a reconnect replaces its old peer or stream and
        keeps the identity (and its seat, even in a full room, and even when the server is busy:
        a seated student is never dropped to make room; one that proves its identity and brings
        audio back after a break may have been seated by a gateway that is gone). The student's
        new audio pipeline, and whether it is new to the room. RoomFull, Busy,
        TooManyFromAddress or BusError when it cannot be seated."""
        key = (room.room_id, student_id)
        held = sum(1 for (r, s), c in self.connections.items() if r == room.room_id and c.address == address and s != student_id)
        self.admission.check(room.room_id, address, limits, held)
        seated = student_id in room.students  # a reconnect: its seat stays whatever happens here
        if not (seated or key in self.connections or (catch_up and resumed)):
            await self.check_capacity(room)
        await self.seats.take(room, student_id)
        try:
            _, new = self.rooms.join(room, student_id, name)
            old = self.connections.pop(key, None)
            for gone in (old.audio if old else None, self._parked.pop(key, None)):
                if gone is not None:
                    gone.close(flush=not catch_up)  # catching up: the page sends its speech again
            if old:
                await old.end("replaced by a newer connection of this student", CLOSE_REPLACED)
            return self.student_audio(room, student_id, name), new
        except BaseException:
            if not seated:
                await self.seats.unseat(room, student_id)
            raise

    def student_audio(self, room: Room, student_id: str, name: str, pacer: Pacer | None = None) -> StudentAudio:
        """A student's audio pipeline (paced, VAD with this server's settings), wired to the sink
        and the room's speaking events; called on the event loop."""
        loop = asyncio.get_running_loop()
        return StudentAudio(
            room.room_id, student_id, name, room.language,
            on_utterance=self.sink.submit,
            on_hint=self.sink.hint,
            on_speaking=lambda speaking: loop.create_task(self._speaking(room, student_id, speaking)),
            config=self.segmenter_config,
            pacer=pacer or Pacer(self.settings.max_audio_rate, on_refused=self.metrics.paced_refusals.inc),
        )
