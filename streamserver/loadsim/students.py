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

from streamserver.loadsim.clients import JoinRefused, join_student, speech_file
from streamserver.loadsim.measure import Tally
from streamserver.loadsim.scenario import load_clips, plan_turns, render
from streamserver.loadsim.ws_student import Pacer, PlayHooks, WsStudent

WEBRTC_LEAD_S = 1.0  # silence before a WebRTC student's audio: what plays before ICE is up is lost


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


class StudentPool:
    def __init__(self, plan: StudentPlan, tally: Tally) -> None:
        self.plan = plan
        self.tally = tally
        self.clips = load_clips(plan.frame_ms)
        self.pacer = Pacer(plan.frame_ms, PlayHooks(tally.clip_started, tally.clip_sent, tally.lag))

    async def run(self, indices: range | list[int]) -> None:
        """Students `indices` of the run (student i sits in room i mod rooms), until the end."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=15)
        joins = asyncio.Semaphore(self.plan.join_concurrency)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            with tempfile.TemporaryDirectory(prefix="loadsim-") as tmp:
                await asyncio.gather(*(self._student(session, i, joins, Path(tmp)) for i in indices))

    def _remaining_s(self) -> float:
        return self.plan.end - time.time()

    async def _student(self, session: aiohttp.ClientSession, index: int, joins: asyncio.Semaphore, tmp: Path) -> None:
        room = self.plan.rooms[index % len(self.plan.rooms)]
        rng = random.Random(self.plan.seed * 1_000_003 + index)
        try:
            if self.plan.webrtc[index]:
                await self._webrtc_student(session, index, room, joins, rng, tmp)
            else:
                await self._ws_student(session, index, room, joins, rng)
        except JoinRefused as refused:
            if refused.busy:
                self.tally.busy_rejections += 1
            else:
                self.tally.join_failures += 1
            self.tally.error("join", str(refused))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
            self.tally.join_failures += 1
            self.tally.error("join", f"{type(error).__name__}: {error}")

    async def _ws_student(self, session: aiohttp.ClientSession, index: int, room: dict, joins: asyncio.Semaphore,
                          rng: random.Random) -> None:
        student = WsStudent(session, room["url"], room, f"student {index + 1}", "")
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
        if student.closed_by_server:
            self.tally.disconnects += 1
            self.tally.error("stream", student.closed_by_server)

    async def _webrtc_student(self, session: aiohttp.ClientSession, index: int, room: dict, joins: asyncio.Semaphore,
                              rng: random.Random, tmp: Path) -> None:
        """An aiortc peer playing its whole turn-taking stream from a file; the pool counts its
        clips on the same timetable as the player."""
        length = max(0.0, self._remaining_s() - WEBRTC_LEAD_S)
        turns = plan_turns(self.clips, length, self.plan.speak_ratio, rng, self.plan.frame_ms)
        wav = speech_file(tmp / f"student{index}.wav", render(turns, length), lead_s=WEBRTC_LEAD_S, tail_s=0.5)
        async with joins:
            pc = await join_student(session, room["url"], room, f"student {index + 1}", wav)
        student_id = pc.student_id  # type: ignore[attr-defined]
        start = time.time() + WEBRTC_LEAD_S
        self.tally.connected += 1
        try:
            for turn in turns:
                await asyncio.sleep(max(0.0, start + turn.start_s - time.time()))
                if pc.connectionState in ("failed", "closed"):
                    self.tally.disconnects += 1
                    self.tally.error("stream", f"WebRTC connection {pc.connectionState}")
                    return
                self.tally.clip_started(student_id)
                await asyncio.sleep(max(0.0, start + turn.end_s - time.time()))
                self.tally.clip_sent(student_id)
            await asyncio.sleep(max(0.0, self.plan.end - time.time()))
        finally:
            self.tally.connected -= 1
            self.tally.speaking.discard(student_id)
            await pc.close()
