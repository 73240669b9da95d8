"""The teacher's dashboard at a lecture's size: a real Chromium page on a real `serve` over Redis,
fed a 10,000-student lecture's events (benchmarks/dashboard_lecture.py: joins in waves, 10 %
speaking with live captions, finals with intent labels, questions filed by the real grouping
code into question_group events) through the room's own channel, as the bus carries them, for
half a minute of class time (the benchmark plays ten minutes). The page keeps up: no main-thread
task over 200 ms, its heap at the end within 2x of the early mark, every transcript counted, the
question groups shown newest first with their counts, the feed's and the queue's rows bounded,
the roster as counts with a search that finds any student, and a second dashboard opened once the
hall is seated lists all of it from its first roster without a long task."""

from __future__ import annotations

from benchmarks.dashboard_lecture import GROUPS_SHOWN, Lecture, measure, question_vectors, verdict
from tests.server_process import ServerProcess
from tests.test_browser import NEEDS_CHROMIUM, _make_room

pytestmark = NEEDS_CHROMIUM
STUDENTS = 10_000
CLASS_S = 30.0  # 10 s of joins, then 20 s at the lecture's rate
EARLY_S = 15.0


def _search(page) -> dict:  # noqa: ANN001 - Playwright's page
    listed = page.eval_on_selector_all("#students > li:not([hidden])", "els => els.length")
    page.fill("#student-search", "student 2345")
    found = page.eval_on_selector_all("#students > li:not([hidden]) .student-name", "els => els.map(e => e.textContent)")
    return {"listed": listed, "found": found}


def test_the_dashboard_keeps_up_with_a_lecture(redis_url, tmp_path):
    vectors = question_vectors()
    with ServerProcess("--redis-url", redis_url) as server:
        room = _make_room(server, "Lecture hall")
        lecture = Lecture(room["room_id"], STUDENTS, CLASS_S, vectors)
        figures = measure(room["teacher_url"], redis_url, lecture, EARLY_S, tmp_path, log=lambda *a: None, inspect=_search)
    checks = verdict(figures, lecture, GROUPS_SHOWN)

    assert checks["no_task_over_200ms"], figures["long_tasks"]
    assert checks["heap_end_within_2x_of_early"], figures["heap_mb"]
    assert checks["every_final_counted"], (figures["counted"], figures["sent"])
    assert checks["groups_shown_with_counts"], checks["groups"]
    assert checks["groups"]["shown"] == min(GROUPS_SHOWN, checks["groups"]["groups"]) > 10, checks["groups"]
    assert figures["sent"]["transcript"] > 3000 and figures["sent"]["transcript_partial"] > 10_000, figures["sent"]
    assert f"{STUDENTS} online" in figures["students_end"] and "0 speaking" in figures["students_end"], figures["students_end"]
    assert figures["feed_rows_end"] <= 400 and figures["queue_rows_end"] <= 200, figures
    assert figures["inspected"]["listed"] == 0  # a lecture lists who is speaking (nobody now), not 10,000 names
    assert figures["inspected"]["found"] == ["Student 2345"], figures["inspected"]
    # A teaching assistant's dashboard opened once the hall is seated: the whole room in its roster.
    assert checks["late_dashboard_no_task_over_200ms"], figures["late_dashboard"]
    assert figures["late_dashboard"]["students"].startswith(f"{STUDENTS} online"), figures["late_dashboard"]
    assert figures["late_dashboard"]["found"] == ["Student 2345"], figures["late_dashboard"]
