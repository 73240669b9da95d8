"""The teacher's dashboard at a lecture's size: a real Chromium page on a real `serve` over Redis,
fed a hall's events (3,000 students joining, speaking, and 2,000 transcripts at a peak's rate)
through the room's own channel, as the bus carries them. The page keeps up: no main-thread
task over 200 ms, every transcript counted, the feed's rows bounded, the roster as counts
with a search that finds any student."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from streamserver.bus.redis import RedisBus
from streamserver.events import StudentEvent, TranscriptEvent, Utterance
from tests.server_process import ServerProcess
from tests.test_browser import NEEDS_CHROMIUM, _launch, _make_room

pytestmark = NEEDS_CHROMIUM
STUDENTS = 3000
TRANSCRIPTS = 2000
LABELS = ["question", "help_request", "answer", "acknowledgement", "off_task", None]


async def _play_hall(redis_url: str, room_id: str) -> None:
    """The hall's events into the room's channel: joins in waves of 300, then transcripts with
    their speaking marks at 400 a second (a peak of a 10,000-student lecture)."""
    bus = RedisBus(redis_url)
    try:
        for first in range(0, STUDENTS, 300):
            await bus.publish_many(room_id, [(StudentEvent(room_id, f"s{i}", f"Student {i}", "student_joined").to_json(), True)
                                             for i in range(first, first + 300)])
            await asyncio.sleep(0.1)
        for first in range(0, TRANSCRIPTS, 40):
            batch = []
            for i in range(first, first + 40):
                student = f"s{(i * 7) % STUDENTS}"
                u = Utterance(f"hall-{i}", room_id, student, f"Student {(i * 7) % STUDENTS}", "en", np.zeros(160, np.float32),
                              time.time() - 2, time.time() - 0.5)
                label = LABELS[i % len(LABELS)]
                event = TranscriptEvent.of(u, f"question number {i} about the slide", "en",
                                           intent={"label": label, "score": 0.9})
                batch += [(StudentEvent(room_id, student, u.student_name, "speaking_started").to_json(), True),
                          (StudentEvent(room_id, student, u.student_name, "speaking_stopped").to_json(), True),
                          (event.to_json(), True)]
            await bus.publish_many(room_id, batch)
            await asyncio.sleep(0.1)
    finally:
        await bus.close()


def test_the_dashboard_keeps_up_with_a_lecture_hall(redis_url, tmp_path):
    from playwright.sync_api import sync_playwright

    from streamserver.loadsim.clients import speech_file

    mic = speech_file(tmp_path / "silence.wav", np.zeros(16000, np.float32))
    with ServerProcess("--redis-url", redis_url) as server:
        room = _make_room(server, "Lecture hall")
        with sync_playwright() as p:
            browser = _launch(p, tmp_path, mic)
            teacher = browser.new_page()
            teacher.goto(room["teacher_url"])
            teacher.locator("#feed-status", has_text="live").wait_for(timeout=15000)
            teacher.evaluate("() => { window.longTasks = []; new PerformanceObserver((list) => "
                             "list.getEntries().forEach((e) => window.longTasks.push(e.duration)))"
                             ".observe({ type: 'longtask', buffered: true }); }")
            with ThreadPoolExecutor(1) as player:  # Playwright's sync API holds this thread's event loop
                player.submit(asyncio.run, _play_hall(redis_url, room["room_id"])).result(timeout=120)
            deadline = time.time() + 60
            counted = 0
            while time.time() < deadline:
                counted = sum(int(n) for n in teacher.eval_on_selector_all("#label-counts .label-count", "els => els.map(e => e.dataset.count)"))
                if counted >= TRANSCRIPTS:
                    break
                time.sleep(0.25)
            rows = teacher.eval_on_selector_all("#feed > li", "els => els.length")
            count_text = teacher.inner_text("#student-count")
            listed = teacher.eval_on_selector_all("#students > li:not([hidden])", "els => els.length")
            teacher.fill("#student-search", "student 2345")
            found = teacher.eval_on_selector_all("#students > li:not([hidden]) .student-name", "els => els.map(e => e.textContent)")
            long_tasks = teacher.evaluate("() => window.longTasks")
            browser.close()

    assert max(long_tasks, default=0) <= 200, sorted(long_tasks)[-5:]
    assert counted == TRANSCRIPTS, counted
    assert f"{STUDENTS} online" in count_text and "0 speaking" in count_text, count_text
    assert rows <= 400, rows  # the feed keeps its newest rows; the export has the whole class
    assert listed == 0  # a lecture lists who is speaking (nobody now), not 3,000 names
    assert found == ["Student 2345"], found
