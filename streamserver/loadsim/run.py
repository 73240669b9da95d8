"""One load-simulation run: rooms, a dashboard per room, students that talk, then a drain wait.

Everything here runs on one event loop (the students too, unless --processes puts them in child
processes: students.py, child.py); nothing blocks it (clips are decoded before the start,
report plots are drawn after the end).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from streamserver.heap import freeze_startup_heap
from streamserver.config import Settings
from streamserver.loadsim import report
from streamserver.loadsim.clients import Dashboard, create_room, next_url
from streamserver.loadsim.config import LoadConfig
from streamserver.loadsim.measure import Tally
from streamserver.loadsim.students import StudentPlan, StudentPool

QUEUE_DEPTH = "streamserver_queue_depth"


def parse_queue_depth(text: str) -> float | None:
    """Sum of the gauge over its label sets in Prometheus text; None when it is absent."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(QUEUE_DEPTH) or line[len(QUEUE_DEPTH) : len(QUEUE_DEPTH) + 1] not in ("{", " "):
            continue
        rest = line[len(QUEUE_DEPTH) :]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1 :]
        try:
            total, found = total + float(rest.split()[0]), True
        except (IndexError, ValueError):
            continue
    return total if found else None


class Run:
    def __init__(self, config: LoadConfig, progress: TextIO | None = sys.stderr) -> None:
        self.config = config
        self.progress = progress
        self.tally = Tally()
        self.timeline: list[dict] = []
        self.metrics_seen = False

    async def run(self, report_dir: Path) -> dict[str, Any]:
        c = self.config
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=15)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            rooms = [await self._create_room(session, i) for i in range(c.rooms)]
            feeds_open = [asyncio.Event() for _ in rooms]
            feeds = [asyncio.create_task(self._feed(session, room, opened)) for room, opened in zip(rooms, feeds_open)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in feeds_open)), 30)
            freeze_startup_heap()  # the rooms and dashboards are set up (streamserver/heap.py)
            self.tally.t0 = time.time()
            sampler = asyncio.create_task(self._sample(session))
            webrtc = [c.transport == "webrtc" or i < c.webrtc_students for i in range(c.students)]
            plan = StudentPlan(rooms, self.tally.t0 + c.duration_s, c.speak_ratio, c.frame_ms, c.seed, webrtc,
                               webrtc_client=c.webrtc_client, keep_audio=c.keep_audio, urls=c.urls)
            if c.processes > 1:
                await self._students_elsewhere(plan)
            else:
                await StudentPool(plan, self.tally).run(range(c.students))
            await self._drain()
            for task in (sampler, *feeds):
                task.cancel()
            await asyncio.gather(sampler, *feeds, return_exceptions=True)
        result = report.build(c.settings(), self.tally, self.timeline, self.metrics_seen)
        report.write(report_dir, result, self.tally)
        return result

    async def _create_room(self, session: aiohttp.ClientSession, index: int) -> dict:
        """A room lives in the server that created it: its students and dashboard go there too."""
        url = self.config.urls[index % len(self.config.urls)]
        # A room big enough for its share of the students (a hall: thousands), never below a
        # server's default size, so that a class sized as before runs as before.
        seats = max(-(-self.config.students // self.config.rooms), Settings.max_students)
        room = await create_room(session, url, self.config.admin_token, f"loadsim {index + 1}", self.config.language, seats)
        return {**room, "url": url}

    async def _students_elsewhere(self, plan: StudentPlan) -> None:
        """The students in child processes (child.py), every k-th one in child k; their counts
        come back as snapshots twice a second. Dashboards and the report stay here."""
        n = self.config.processes
        children = [
            await asyncio.create_subprocess_exec(sys.executable, "-m", "streamserver.loadsim.child", stdin=asyncio.subprocess.PIPE,
                                                 stdout=asyncio.subprocess.PIPE, limit=1 << 24)
            for _ in range(n)
        ]
        for k, child in enumerate(children):
            assert child.stdin is not None
            child.stdin.write(json.dumps({"plan": asdict(plan), "indices": list(range(k, self.config.students, n))}).encode())
            await child.stdin.drain()
            child.stdin.close()
        await asyncio.gather(*(self._follow(k, child) for k, child in enumerate(children)))

    async def _follow(self, k: int, child: asyncio.subprocess.Process) -> None:
        assert child.stdout is not None
        async for line in child.stdout:
            self.tally.absorb(k, json.loads(line))
        if (code := await child.wait()) != 0:
            self.tally.error("process", f"student process {k} exited with status {code} (its stderr is above)")

    # -- dashboards, metrics, progress -----------------------------------------------------
    async def _feed(self, session: aiohttp.ClientSession, room: dict, opened: asyncio.Event) -> None:
        """The room's teacher dashboard for the whole run; reconnects (and replays the room's
        history) when the server drops it."""
        url = room["url"]
        while True:
            dashboard = Dashboard(self.tally.feed_event)
            try:
                await dashboard.open(session, url, room)
                opened.set()
                await dashboard.closed()
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
                self.tally.error("feed", f"{type(error).__name__}: {error}")
                url = next_url(self.config.urls, url)  # a gateway gone: its rooms are served by the others (Redis)
            finally:
                await dashboard.close()
            await asyncio.sleep(1.0)

    async def _queue_depth(self, session: aiohttp.ClientSession) -> float:
        """The deepest queue any server reports (gateways sharing one job queue all report it)."""
        metric = lambda url: self._metric(session, url, self.config.admin_token)  # noqa: E731
        depths = [d for d in await asyncio.gather(*(metric(url) for url in self.config.urls)) if d is not None]
        self.metrics_seen |= bool(depths)
        return max(depths, default=0.0)

    @staticmethod
    async def _metric(session: aiohttp.ClientSession, url: str, admin_token: str) -> float | None:
        """The server's queue depth; /metrics takes the admin token."""
        try:
            async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=1),
                                   headers={"Authorization": f"Bearer {admin_token}"}) as r:
                return parse_queue_depth(await r.text()) if r.status == 200 else None
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return None

    async def _sample(self, session: aiohttp.ClientSession) -> None:
        """Once a second: a timeline row, and a progress line on stderr."""
        tick = 0
        while True:
            tick += 1
            depth = await self._queue_depth(session)
            t = self.tally
            lat = t.latency_stats()
            row = {"t": round(time.time() - t.t0, 2), "connected": t.connected_now(), "active_speakers": t.speaking_now(),
                   "utterances_sent": t.utterances_sent, "transcripts_received": len(t.transcripts),
                   "queue_depth": depth, "latency_p50": lat["p50"], "latency_p99": lat["p99"]}
            self.timeline.append(row)
            if self.progress:
                ms = lambda v: "-" if v is None else f"{v:.2f}s"  # noqa: E731
                print(f"loadsim: {row['t']:5.0f}s students {row['connected']}/{self.config.students} speaking {row['active_speakers']}"
                      f" sent {t.utterances_sent} transcripts {row['transcripts_received']} p50 {ms(lat['p50'])}"
                      f" p99 {ms(lat['p99'])} queue {depth:.0f} failed {t.join_failures} busy {t.busy_rejections}",
                      file=self.progress, flush=True)
            await asyncio.sleep(max(0.0, t.t0 + tick - time.time()))

    async def _drain(self) -> None:
        """After the last student: wait (at most drain_s) for the transcripts still due."""
        deadline = time.monotonic() + self.config.drain_s
        while self.tally.pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)  # a duplicate would arrive right behind its first copy
