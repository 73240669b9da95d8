"""A pool of simulated students: each joins its room, takes its turns until the end of the run,
and leaves; what they do is counted in a Tally (the run's own, or a child process's)."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiortc.contrib.media import MediaPlayer

from streamserver.loadsim.clients import JoinRefused, join_student, loopback_source, speech_file
from streamserver.loadsim.config import LoadConfig
from streamserver.loadsim.measure import Tally
from streamserver.loadsim.scenario import Turn, load_clips, plan_turns, render
from streamserver.loadsim.webrtc_student import PACKET_S, OpusPlanTrack, PacketClock, TimedTrack, encoded_clips, on_consent_expired
from streamserver.loadsim.ws_student import Pacer, PlayHooks, WsStudent, reconnect_wait

# Silence before a WebRTC student's first clip: the packets client starts its plan when the
# connection is up, and the server's side of DTLS may finish a round trip after ours; aiortc's
# MediaPlayer starts playing its file at the same moment.
WEBRTC_LEAD_S = {"packets": 0.5, "encoder": 1.0}
# How long after the end of the run a WebRTC student whose stream is not all sent yet (the
# simulator fell behind real time) keeps sending before it hangs up; what is left is counted
# as clips_unsent.
HANGUP_GRACE_S = 10.0
LATE_JOIN_S = 5.0  # a student told busy stops trying when less of the class than this is left (about one utterance)
PHASES = 4  # a packets student sends on one of 4 phases of each 20 ms (browsers are not in step)
WEBRTC_CLIENTS = ("packets", "encoder")  # pre-encoded Opus packets; aiortc's MediaPlayer, encoding per student


@dataclass
class StudentPlan:
    """What a pool needs to know: the same in every process of a run."""

    rooms: list[dict]  # as created, each with the "url" of the server that holds it
    end: float  # epoch seconds: every student stops streaming then
    speak_ratio: float
    frame_ms: int
    seed: int
    webrtc: list[bool]  # per student index: over WebRTC rather than the WebSocket ingest
    join_concurrency: int = 32  # handshakes in flight at once, per pool
    webrtc_client: str = LoadConfig.webrtc_client  # one of WEBRTC_CLIENTS
    keep_audio: bool = LoadConfig.keep_audio  # WebSocket students keep their audio and send it again after a break
    urls: list[str] | None = None  # every server of the run: a student whose server is gone reconnects through the next


class StudentPool:
    def __init__(self, plan: StudentPlan, tally: Tally) -> None:
        self.plan = plan
        self.tally = tally
        self.clips = load_clips(plan.frame_ms)
        self.hooks = PlayHooks(tally.clip_started, tally.clip_sent, tally.lag)
        self.pacer = Pacer(plan.frame_ms, self.hooks)
        # every WebRTC packets student of the process, on PHASES phases of each 20 ms
        self.clock = PacketClock(tally.lag, packet_s=PACKET_S / PHASES)

    async def run(self, indices: range | list[int]) -> None:
        """Students `indices` of the run (student i sits in room i mod rooms), until the end."""
        if any(self.plan.webrtc[i] for i in indices):
            on_consent_expired(self._consent_expired)
            if self.plan.webrtc_client == "packets":
                encoded_clips(self.plan.frame_ms)  # once, before the first student: not on the running loop's time
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=15)
        joins = asyncio.Semaphore(self.plan.join_concurrency)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            with tempfile.TemporaryDirectory(prefix="loadsim-") as tmp:
                await asyncio.gather(*(self._student(session, i, joins, Path(tmp)) for i in indices))

    def _consent_expired(self) -> None:
        self.tally.ice_consent_expired += 1

    def _remaining_s(self) -> float:
        return self.plan.end - time.time()

    def _room_of(self, index: int) -> dict:
        """Student `index`'s room, with the server it joins through: the room's own, unless the
        run has fewer rooms than servers; then a room's students are dealt over every server, as
        a load balancer in front of them would (a lecture of thousands is more than one gateway's
        event loop carries; the room's seats and events are shared through the bus)."""
        room = self.plan.rooms[index % len(self.plan.rooms)]
        urls = self.plan.urls or []
        if len(self.plan.rooms) < len(urls):
            return {**room, "url": urls[index // len(self.plan.rooms) % len(urls)]}
        return room

    async def _student(self, session: aiohttp.ClientSession, index: int, joins: asyncio.Semaphore, tmp: Path) -> None:
        """One student through the class. Told busy, it tries again after the server's
        Retry-After, as the student page does (web_demo/student.js), until too little of the
        class is left to join; so does one whose join got no answer (a network error); any other
        refusal ends its class."""
        room = self._room_of(index)
        rng = random.Random(self.plan.seed * 1_000_003 + index)
        tries = 0
        while True:
            try:
                if self.plan.webrtc[index]:
                    await self._webrtc_student(session, index, room, joins, rng, tmp)
                else:
                    await self._ws_student(session, index, room, joins, rng)
                return
            except JoinRefused as refused:
                if not refused.busy:
                    self.tally.join_failures += 1
                    self.tally.error("join", str(refused))
                    return
                self.tally.busy_rejections += 1
                wait = reconnect_wait(tries, refused.retry_after_s)
                tries += 1
                if self._remaining_s() - wait < LATE_JOIN_S:
                    self.tally.never_seated += 1
                    self.tally.error("join", str(refused))
                    return
                await asyncio.sleep(wait)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
                # No answer at all (a reset, a timeout): the page tries again after a jittered
                # wait, as after a break; only a class that ends first makes it a failure.
                self.tally.error("join", f"{type(error).__name__}: {error}")
                wait = reconnect_wait(tries)
                tries += 1
                if self._remaining_s() - wait < LATE_JOIN_S:
                    self.tally.join_failures += 1
                    return
                self.tally.join_retries += 1
                await asyncio.sleep(wait)

    async def _ws_student(self, session: aiohttp.ClientSession, index: int, room: dict, joins: asyncio.Semaphore,
                          rng: random.Random) -> None:
        urls = self.plan.urls or [room["url"]]
        at = urls.index(room["url"]) if room["url"] in urls else 0
        student = WsStudent(session, room["url"], room, f"student {index + 1}", "", keeps=self.plan.keep_audio,
                            urls=urls[at:] + urls[:at])
        async with joins:
            await student.connect()
        self.tally.connected += 1
        try:
            length = self._remaining_s()
            await self.pacer.play(student, plan_turns(self.clips, length, self.plan.speak_ratio, rng, self.plan.frame_ms), length)
        finally:
            self.tally.connected -= 1
            self.tally.speaking.discard(student.student_id)
            await student.close()
            self.tally.reconnects += student.reconnects
            self.tally.reconnect_causes.update(student.breaks)
        if student.closed_by_server:
            self.tally.disconnects += 1
            self.tally.error("stream", student.closed_by_server)

    async def _webrtc_student(self, session: aiohttp.ClientSession, index: int, room: dict, joins: asyncio.Semaphore,
                              rng: random.Random, tmp: Path) -> None:
        """An aiortc peer: its microphone sends the student's turn-taking plan (pre-encoded Opus
        packets, or a file that aiortc's MediaPlayer plays and encodes), its clips counted as they
        are handed to the sender. It hangs up when its stream is all sent, or HANGUP_GRACE_S after
        the end of the run (clips not sent by then: clips_unsent), or when the connection closes."""
        plan = self.plan
        lead = WEBRTC_LEAD_S[plan.webrtc_client]
        track: OpusPlanTrack | TimedTrack
        if plan.webrtc_client == "packets":
            track = OpusPlanTrack(self.clock, lambda length: plan_turns(self.clips, length, plan.speak_ratio, rng, plan.frame_ms),
                                  plan.end, self.hooks, lead_s=lead, clips=encoded_clips(plan.frame_ms))
        else:
            length = max(0.0, self._remaining_s() - lead)
            turns = plan_turns(self.clips, length, plan.speak_ratio, rng, plan.frame_ms)
            wav = speech_file(tmp / f"student{index}.wav", render(turns, length), lead_s=lead, tail_s=0.5)
            track = TimedTrack(MediaPlayer(str(wav), loop=False).audio, [Turn(t.start_s + lead, t.clip) for t in turns], self.hooks)
        try:
            async with joins:
                pc = await join_student(session, room["url"], room, f"student {index + 1}", track,
                                        source=loopback_source(room["url"], index))
        except BaseException:
            track.stop()
            raise
        track.student_id = pc.student_id  # type: ignore[attr-defined]
        self.tally.connected += 1
        closed = asyncio.Event()

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState in ("failed", "closed"):
                closed.set()

        try:
            waits = [asyncio.ensure_future(track.finished.wait()), asyncio.ensure_future(closed.wait())]
            ended, _ = await asyncio.wait(waits, timeout=max(0.0, self._remaining_s()) + HANGUP_GRACE_S,
                                          return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        finally:
            self.tally.connected -= 1
            self.tally.speaking.discard(track.student_id)
            state = pc.connectionState
            await pc.close()
            track.stop()
        if not track.complete:
            self.tally.clips_unsent += track.timetable.unsent
            if ended:  # the connection went away under it
                self.tally.disconnects += 1
                self.tally.error("stream", f"WebRTC connection {state} before the student's stream ended")
            else:
                self.tally.error("simulator", "a WebRTC student's stream was not all sent by the end of the run (+"
                                 f"{HANGUP_GRACE_S:g} s): the simulator fell behind real time")
