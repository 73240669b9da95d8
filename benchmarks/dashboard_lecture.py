"""The teacher's dashboard through a lecture: a real `serve` over a real redis-server, one headless
Chromium dashboard, and a 10,000-student lecture's event stream replayed into the room's channel
at real-time rate (RedisBus.publish_many, as the server's own publisher sends them), each student
seated on the bus before their join is announced, as a gateway seats them (the roster a feed
opens with lists them).

The lecture: the students join in waves, then 10 % of them speak at any moment (utterances of
2-7.3 s, mean 4.67 s: ~214 finals a second). Each utterance makes what the server makes of it:
speaking_started, live captions (transcript_partial) after 0.5 s of voice and then every second
(serve's --partial-interval-ms default) 0.3 s after their audio, speaking_stopped at its end, and
its final 0.5 s later with an intent label. Questions and help requests are drawn from the
paraphrased lecture questions (benchmarks/questions/paraphrases.jsonl, English and Mandarin) and
filed by the real grouping code (streamserver/intent/groups.py, the intent labeller's e5 vectors
of those texts); each group that grew is sent as a `question_group` event (its Group.to_dict()),
once per tick. At the end the class stops: who is speaking finishes.

Measured in the page: main-thread long tasks (PerformanceObserver 'longtask'), the JS heap after
a full garbage collection (CDP) after the first minute and at the end, the DOM's size, the
transcripts the page counted against those sent, and the question groups it shows with their
counts against the grouping's. Must show (issue 29, item 3): no task over 200 ms, heap at the end
within 2x of after 1 minute, groups shown with their counts. Exits 1 when one fails.

    flock /tmp/cpu-bench.lock .venv/bin/python -m benchmarks.dashboard_lecture --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import heapq
import json
import random
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from streamserver.bus.redis import RedisBus
from streamserver.events import StudentEvent, TranscriptEvent, TranscriptPartialEvent, Utterance
from streamserver.intent.groups import QuestionGroups

HERE = Path(__file__).parent
QUESTIONS = HERE / "questions" / "paraphrases.jsonl"
SENTENCES = HERE / "sentences_en.txt"
RESULTS = HERE / "results" / "dashboard-lecture.json"
TICK_S = 0.1
JOIN_WAVE = 500  # students per wave, one wave per JOIN_WAVE_S
JOIN_WAVE_S = 0.5
SEAT_HOLDER = "lecture-replay"  # the lease holder of the students' seats: a gateway's id in a class
SEAT_LEASE_MARGIN_S = 120.0  # the seats outlast the replay by this much (the page is read after it)
SEATS_IN_FLIGHT = 64
UTTERANCE_S = (2.0, 7.34)  # uniform: mean 4.67 s
FIRST_CAPTION_S, CAPTION_EVERY_S = 0.5, 1.0  # audio/segmenter.py: half an interval, then every interval
CAPTION_LAG_S, FINAL_LAG_S = 0.3, 0.5  # recognition; a final after the hangover
# The intent labels of a lecture's finals (None: the labeller is unsure).
LABEL_SHARES = {"question": 0.2, "help_request": 0.05, "answer": 0.35, "acknowledgement": 0.2, "off_task": 0.1, None: 0.1}
ASKING = ("question", "help_request")
MAX_LONG_TASK_MS = 200
MAX_HEAP_GROWTH = 2.0
SILENCE = np.zeros(160, np.float32)

# In the page from its first script on: long tasks, kept as counts (an array of thousands would
# be part of the heap measured), and when the longest ten were, to leave out the full garbage
# collections that the heap's measurement forces (window.__gc: their spans).
LONG_TASKS = """
window.__long = { n: 0, max: 0, over200: 0, top: [] };
window.__gc = [];
new PerformanceObserver((list) => { for (const e of list.getEntries()) {
  if (window.__gc.some(([a, b]) => e.startTime < b && e.startTime + e.duration > a)) continue;
  const l = window.__long; l.n++; l.max = Math.max(l.max, e.duration); if (e.duration > 200) l.over200++;
  l.top.push([Math.round(e.duration), Math.round(e.startTime)]); l.top.sort((a, b) => b[0] - a[0]);
  l.top.length = Math.min(l.top.length, 10);
} }).observe({ type: 'longtask' });
"""


@dataclass
class Speech:
    utterance_id: str
    student: int
    text: str
    language: str
    label: str | None
    start: float  # class time
    end: float
    start_ts: float  # wall time
    captions: int = 0


@dataclass
class Sent:
    """What the replay has published so far (read by the measuring thread)."""

    by_type: dict[str, int] = field(default_factory=dict)
    class_s: float = 0.0
    done: bool = False

    def count(self, kind: str, n: int = 1) -> None:
        self.by_type[kind] = self.by_type.get(kind, 0) + n


class Lecture:
    """A lecture's events, in class time (seconds from its start); `vectors` holds the e5
    vector of each question text, for the room's QuestionGroups."""

    def __init__(self, room_id: str, students: int, seconds: float, vectors: dict[str, np.ndarray],
                 speaking: float = 0.1, seed: int = 1) -> None:
        self.room_id, self.students, self.seconds, self.vectors = room_id, students, seconds, vectors
        self.speakers_wanted = round(students * speaking)
        self.rng = random.Random(seed)
        self.questions = [json.loads(line) for line in QUESTIONS.read_text(encoding="utf-8").splitlines() if line.strip()]
        self.sentences = [s for s in SENTENCES.read_text(encoding="utf-8").splitlines() if s.strip()]
        self.groups = QuestionGroups()
        self.joined = 0
        self.arrived: list[int] = []  # students whose joins until() returned, not yet seated by replay()
        self.speaking: dict[int, Speech] = {}
        self.quiet = list(range(students))  # not speaking now
        self.due: list[tuple[float, int, str, Speech]] = []  # (class time, order, what, speech)
        self.order = 0
        self.spoken = 0

    @property
    def join_s(self) -> float:
        return JOIN_WAVE_S * -(-self.students // JOIN_WAVE)

    def name(self, student: int) -> str:
        return f"Student {student}"

    def until(self, t: float, sent: Sent) -> list[tuple[str, bool]]:
        """The events up to class time t: (JSON, kept in the history)."""
        out: list[tuple[str, bool]] = []
        while self.joined < self.students and self.joined // JOIN_WAVE * JOIN_WAVE_S <= t:
            wave = range(self.joined, min(self.students, self.joined + JOIN_WAVE))
            out += [(self._student(s, "student_joined"), True) for s in wave]
            self.arrived += wave
            sent.count("student_joined", len(wave))
            self.joined = wave.stop
        if self.join_s <= t < self.seconds:
            while len(self.speaking) < self.speakers_wanted:
                self._start(t, out, sent)
        if t >= self.seconds:  # the class ends: who speaks stops now
            for speech in list(self.speaking.values()):
                speech.end = min(speech.end, self.seconds)
                self._schedule(speech.end, "stop", speech)
        changed: dict[int, dict] = {}
        while self.due and self.due[0][0] <= t:
            _, _, what, speech = heapq.heappop(self.due)
            self._happen(what, speech, out, sent, changed)
        out += [(json.dumps({"type": "question_group", "room_id": self.room_id, **g}), True) for g in changed.values()]
        sent.count("question_group", len(changed))
        return out

    def _start(self, t: float, out: list, sent: Sent) -> None:
        student = self.quiet.pop(self.rng.randrange(len(self.quiet)))
        label = self.rng.choices(list(LABEL_SHARES), weights=list(LABEL_SHARES.values()))[0]
        if label in ASKING:
            q = self.rng.choice(self.questions)
            text, language = q["text"], q["lang"]
        else:
            text, language = self.rng.choice(self.sentences), "en"
        length = self.rng.uniform(*UTTERANCE_S)
        if t < self.join_s + UTTERANCE_S[1]:  # the first speakers are part-way through already
            length *= self.rng.random()
        speech = Speech(f"lecture-{self.spoken}", student, text, language, label, t, t + max(length, 0.3), time.time())
        self.spoken += 1
        self.speaking[student] = speech
        out.append((self._student(student, "speaking_started"), True))
        sent.count("speaking_started")
        self._schedule(t + FIRST_CAPTION_S + CAPTION_LAG_S, "caption", speech)
        self._schedule(speech.end, "stop", speech)

    def _schedule(self, at: float, what: str, speech: Speech) -> None:
        self.order += 1
        heapq.heappush(self.due, (at, self.order, what, speech))

    def _happen(self, what: str, speech: Speech, out: list, sent: Sent, changed: dict[int, dict]) -> None:
        if what == "caption":
            if self.speaking.get(speech.student) is not speech:
                return  # ended meanwhile
            speech.captions += 1
            heard = FIRST_CAPTION_S + (speech.captions - 1) * CAPTION_EVERY_S
            out.append((TranscriptPartialEvent.of(self._utterance(speech, "partial"), self._words(speech, heard), speech.language).to_json(), False))
            sent.count("transcript_partial")
            self._schedule(speech.start + heard + CAPTION_EVERY_S + CAPTION_LAG_S, "caption", speech)
        elif what == "stop":
            if self.speaking.get(speech.student) is not speech:
                return  # stopped already (the class ended)
            del self.speaking[speech.student]
            self.quiet.append(speech.student)
            out.append((self._student(speech.student, "speaking_stopped"), True))
            sent.count("speaking_stopped")
            self._schedule(speech.end + FINAL_LAG_S, "final", speech)
        else:
            u = self._utterance(speech, "final")
            out.append((TranscriptEvent.of(u, speech.text, speech.language, intent={"label": speech.label, "score": 0.9}).to_json(), True))
            sent.count("transcript")
            if speech.label in ASKING:
                group = self.groups.add(u.utterance_id, f"s{speech.student}", speech.text, self.vectors[speech.text],
                                        time.time(), speech.language)
                changed[group.group_id] = group.to_dict()

    def _words(self, speech: Speech, heard: float) -> str:
        """The text so far: its share of the words (of the characters, for Mandarin)."""
        share = min(1.0, heard / (speech.end - speech.start))
        if speech.language == "zh":
            return speech.text[:max(1, round(len(speech.text) * share))]
        words = speech.text.split()
        return " ".join(words[:max(1, round(len(words) * share))])

    def _utterance(self, speech: Speech, kind: str) -> Utterance:
        end_ts = speech.start_ts + (speech.end - speech.start)
        return Utterance(speech.utterance_id, self.room_id, f"s{speech.student}", self.name(speech.student), speech.language,
                         SILENCE, speech.start_ts, end_ts, kind=kind, revision=speech.captions)

    def _student(self, student: int, kind: str) -> str:
        return StudentEvent(self.room_id, f"s{student}", self.name(student), kind).to_json()


def question_vectors() -> dict[str, np.ndarray]:
    """The intent labeller's e5 vector of each paraphrased question (ONNX Runtime, the CPU default)."""
    from streamserver.intent.e5_onnx import OnnxE5Embedder

    texts = list(dict.fromkeys(json.loads(line)["text"] for line in QUESTIONS.read_text(encoding="utf-8").splitlines() if line.strip()))
    return dict(zip(texts, OnnxE5Embedder().embed(texts)))


async def seat(bus: RedisBus, lecture: Lecture, lease_s: float) -> None:
    """The students who join now take their seats on the bus, as their gateways would before
    announcing them: a dashboard's roster (every gateway's students) lists them."""
    turns = asyncio.Semaphore(SEATS_IN_FLIGHT)

    async def take(student: int) -> None:
        async with turns:
            await bus.take_seat(lecture.room_id, f"s{student}", lecture.students, lease_s, SEAT_HOLDER, lecture.name(student))

    await asyncio.gather(*(take(student) for student in lecture.arrived))
    lecture.arrived.clear()


async def replay(redis_url: str, lecture: Lecture, sent: Sent, drain_s: float = 2.0) -> None:
    """The lecture's events at real-time rate, one publish_many per tick."""
    bus = RedisBus(redis_url)
    started = time.monotonic()
    ends_s = lecture.seconds + FINAL_LAG_S + drain_s
    try:
        while (t := time.monotonic() - started) < ends_s:
            sent.class_s = t
            events = lecture.until(t, sent)
            await seat(bus, lecture, ends_s + SEAT_LEASE_MARGIN_S)
            if events:
                await bus.publish_many(lecture.room_id, events)
            await asyncio.sleep(max(0.0, TICK_S - (time.monotonic() - started - t)))
    finally:
        sent.done = True
        await bus.close()


def say(*parts: object) -> None:
    print(*parts, flush=True)


def _page_state(page) -> dict:  # noqa: ANN001 - Playwright's page
    return page.evaluate("""() => ({
      counted: [...document.querySelectorAll('#label-counts .label-count')].reduce((n, e) => n + Number(e.dataset.count), 0),
      nodes: document.getElementsByTagName('*').length,
      feed: document.querySelectorAll('#feed > li').length,
      queue: document.querySelectorAll('#queue > li').length,
      long: window.__long,
      students: document.getElementById('student-count').textContent,
    })""")


def _heap(page, cdp) -> float:  # noqa: ANN001 - Playwright's page and CDPSession
    """The page's JS heap in MB after a full collection (whose task is no task of the page's)."""
    page.evaluate("() => window.__gc.push([performance.now(), Infinity])")
    cdp.send("HeapProfiler.collectGarbage")
    used = cdp.send("Runtime.getHeapUsage")["usedSize"]
    page.evaluate("() => { window.__gc[window.__gc.length - 1][1] = performance.now() + 50; }")
    return round(used / 1e6, 2)


TRACE_CATEGORIES = ["devtools.timeline", "disabled-by-default-devtools.timeline", "v8.execute", "blink.user_timing"]


def _start_trace(cdp) -> None:  # noqa: ANN001 - Playwright's CDPSession
    cdp.send("Tracing.start", {"transferMode": "ReturnAsStream",
                               "traceConfig": {"includedCategories": TRACE_CATEGORIES, "excludedCategories": ["*"]}})


def _end_trace(page, cdp, path: Path) -> None:  # noqa: ANN001 - Playwright's page and CDPSession
    """Stops the trace and writes it to path (read from the browser in 4 MB pieces)."""
    complete: dict = {}
    cdp.on("Tracing.tracingComplete", lambda event: complete.update(event))
    cdp.send("Tracing.end")
    while "stream" not in complete:
        page.wait_for_timeout(100)  # the sync API delivers the event while it waits
    with path.open("wb") as out:
        while True:
            piece = cdp.send("IO.read", {"handle": complete["stream"], "size": 4 << 20})
            out.write(base64.b64decode(piece["data"]) if piece.get("base64Encoded") else piece["data"].encode())
            if piece.get("eof"):
                break
    cdp.send("IO.close", {"handle": complete["stream"]})


def trace_summary(path: Path) -> dict:
    """Where the page's main thread went, from a --trace file: seconds in tasks, layouts,
    paint-property updates and paints, and how many animation frames laid the page out once,
    twice... inside their callbacks (a read of a size after a change forces a layout there)."""
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    mains = {(e["pid"], e["tid"]) for e in events
             if e.get("name") == "thread_name" and e.get("args", {}).get("name") == "CrRendererMain"}
    busy: Counter = Counter()
    for e in events:
        if (e.get("pid"), e.get("tid")) in mains and e.get("ph") == "X" and e.get("name") == "RunTask":
            busy[(e["pid"], e["tid"])] += e.get("dur", 0)
    if not busy:
        return {"error": "no renderer main thread with tasks in the trace"}
    page = busy.most_common(1)[0][0]  # the lecture's page: the busiest renderer
    spans = [e for e in events if (e.get("pid"), e.get("tid")) == page and e.get("ph") == "X"]
    seconds: Counter = Counter()
    for e in spans:
        seconds[e["name"]] += e.get("dur", 0) / 1e6
    layouts = sorted(e["ts"] for e in spans if e["name"] == "Layout")
    per_frame = Counter(bisect.bisect_left(layouts, f["ts"] + f["dur"]) - bisect.bisect_left(layouts, f["ts"])
                        for f in spans if f["name"] == "FireAnimationFrame")
    return {**{f"{name}_s": round(seconds[name], 2) for name in ("RunTask", "FunctionCall", "Layout", "PrePaint", "Paint")},
            "layouts": len(layouts), "frames_by_layouts_inside": {str(k): v for k, v in sorted(per_frame.items())},
            "longest_tasks_ms": sorted((round(e["dur"] / 1000) for e in spans if e["name"] == "RunTask"), reverse=True)[:5]}


def _groups_shown(page) -> list[dict]:  # noqa: ANN001
    return page.eval_on_selector_all("#groups > li", """els => els.map(e => ({
      group_id: Number(e.dataset.groupId), count: Number(e.dataset.count),
      count_text: e.querySelector('.group-count').textContent, question: e.querySelector('.group-question').textContent }))""")


def check_groups(shown: list[dict], groups: QuestionGroups, most_shown: int) -> dict:
    """The groups the page shows against the grouping's: the newest ones, each with its count."""
    expected = [g.group_id for g in groups.newest_first(most_shown)]
    wrong = [s for s in shown if (g := groups.groups.get(s["group_id"])) is None or s["count"] != g.count
             or s["count_text"].strip() != str(g.count) or s["question"] != g.representative]
    return {"groups": len(groups.groups), "shown": len(shown), "newest_shown": [s["group_id"] for s in shown] == expected,
            "wrong": wrong[:5], "top": [{"count": s["count"], "question": s["question"]} for s in shown[:5]],
            "ok": bool(shown) and not wrong and [s["group_id"] for s in shown] == expected}


def measure(page_url: str, redis_url: str, lecture: Lecture, early_s: float, tmp: Path,  # noqa: C901 - one run's timeline
            progress_s: float = 15.0, log=say, inspect=None, trace: Path | None = None) -> dict:  # noqa: ANN001
    """Plays `lecture` into the dashboard at page_url; the page's figures (and inspect(page)'s,
    at the end). trace: a Chrome performance trace of the page written there (chrome://tracing,
    or the DevTools Performance panel's "load profile")."""
    from playwright.sync_api import sync_playwright

    from tests.test_browser import _launch
    from streamserver.loadsim.clients import speech_file

    mic = speech_file(tmp / "silence.wav", np.zeros(16000, np.float32))
    sent = Sent()
    timeline: list[dict] = []
    with sync_playwright() as p:
        browser = _launch(p, tmp, mic)
        page = browser.new_page()
        page.add_init_script(LONG_TASKS)
        page.goto(page_url)
        page.locator("#feed-status", has_text="live").wait_for(timeout=15000)
        cdp = browser.new_cdp_session(page)
        heap_start = _heap(page, cdp)
        if trace:
            _start_trace(cdp)
        with ThreadPoolExecutor(1) as player:  # Playwright's sync API holds this thread's event loop
            done = player.submit(asyncio.run, replay(redis_url, lecture, sent))
            heap_early = None
            next_progress = progress_s
            while not done.done():
                time.sleep(0.5)
                if heap_early is None and sent.class_s >= early_s:
                    heap_early = _heap(page, cdp)
                    timeline.append({"class_s": round(sent.class_s, 1), "heap_mb": heap_early, **_page_state(page)})
                    log(f"  {sent.class_s:6.1f} s  heap after GC {heap_early} MB (the early mark)")
                if sent.class_s >= next_progress:
                    next_progress += progress_s
                    state = _page_state(page)
                    timeline.append({"class_s": round(sent.class_s, 1), **state})
                    log(f"  {sent.class_s:6.1f} s  sent {sent.by_type.get('transcript', 0)} finals, "
                        f"{sent.by_type.get('transcript_partial', 0)} captions, {sent.by_type.get('question_group', 0)} group updates; "
                        f"page counted {state['counted']}, {state['nodes']} DOM nodes, longest task {state['long']['max']:.0f} ms; "
                        f"{state['students']}")
            done.result()
        if trace:
            _end_trace(page, cdp, trace)
        finals = sent.by_type.get("transcript", 0)
        deadline = time.time() + 60
        while (state := _page_state(page))["counted"] < finals and time.time() < deadline:
            time.sleep(0.25)
        caught_up_s = round(60 - (deadline - time.time()), 2)
        page.wait_for_timeout(500)  # the groups are drawn at the next frame
        heap_end = _heap(page, cdp)
        shown = _groups_shown(page)
        inspected = inspect(page) if inspect else None
        late = _late_dashboard(browser, page_url, lecture.students)
        browser.close()
    return {"sent": sent.by_type, "counted": state["counted"], "caught_up_after_end_s": caught_up_s,
            "long_tasks": state["long"], "heap_mb": {"loaded": heap_start, "early": heap_early, "end": heap_end},
            "dom_nodes_end": state["nodes"], "feed_rows_end": state["feed"], "queue_rows_end": state["queue"],
            "students_end": state["students"], "groups": shown, "timeline": timeline, "late_dashboard": late,
            **({"inspected": inspected} if inspect else {})}


def _late_dashboard(browser, page_url: str, students: int) -> dict:  # noqa: ANN001 - Playwright's context
    """A second dashboard (a teaching assistant's) opened once the hall is seated: its feed opens
    with the whole room's roster in one message. How long until it lists everyone, and its longest
    main-thread task meanwhile."""
    page = browser.new_page()
    page.add_init_script(LONG_TASKS)
    started = time.monotonic()
    page.goto(page_url)
    page.locator("#student-count", has_text=f"{students} online").wait_for(timeout=30000)
    listed_s = round(time.monotonic() - started, 2)
    page.wait_for_timeout(500)  # a long task is reported once it has ended
    state = _page_state(page)
    page.fill("#student-search", "student 2345")  # the names came with the roster
    found = page.eval_on_selector_all("#students > li:not([hidden]) .student-name", "els => els.map(e => e.textContent)")
    page.close()
    return {"listed_s": listed_s, "students": state["students"], "long_tasks": state["long"], "found": found}


def verdict(figures: dict, lecture: Lecture, groups_shown_most: int) -> dict:
    heap = figures["heap_mb"]
    groups = check_groups(figures.pop("groups"), lecture.groups, groups_shown_most)
    return {
        "no_task_over_200ms": figures["long_tasks"]["max"] <= MAX_LONG_TASK_MS,
        "heap_end_within_2x_of_early": heap["early"] is not None and heap["end"] <= MAX_HEAP_GROWTH * heap["early"],
        "groups_shown_with_counts": groups["ok"],
        "every_final_counted": figures["counted"] == figures["sent"].get("transcript", 0),
        "late_dashboard_no_task_over_200ms": figures["late_dashboard"]["long_tasks"]["max"] <= MAX_LONG_TASK_MS,
        "groups": groups,
    }


def run(minutes: float, students: int, early_s: float, redis_url: str | None = None, log=say,  # noqa: ANN001
        trace: Path | None = None) -> dict:
    """One lecture against a fresh `serve` (and a fresh redis-server unless redis_url)."""
    from tests.redis_server import RedisServer
    from tests.server_process import ServerProcess
    from tests.test_browser import _make_room

    vectors = question_vectors()
    redis = None if redis_url else RedisServer().start()
    url = redis_url or redis.url
    try:
        with ServerProcess("--redis-url", url) as server, tempfile.TemporaryDirectory() as tmp:
            room = _make_room(server, "Lecture")
            lecture = Lecture(room["room_id"], students, minutes * 60, vectors)
            log(f"{students} students, {minutes} min of class; the dashboard at {server.url}")
            figures = measure(room["teacher_url"], url, lecture, early_s, Path(tmp), log=log, trace=trace)
    finally:
        if redis is not None:
            redis.stop()
    return {**figures, "checks": verdict(figures, lecture, GROUPS_SHOWN)}


GROUPS_SHOWN = 30  # the dashboard's GROUPS_SHOWN (teacher.js)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="class time (default %(default)s)")
    parser.add_argument("--students", type=int, default=10_000)
    parser.add_argument("--early-s", type=float, default=60.0, help="the heap's first mark, class seconds (default %(default)s)")
    parser.add_argument("--trace", type=Path, help="write the page's Chrome performance trace here (large: ~10 MB a minute)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="runs appended here (default %(default)s)")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    report = run(args.minutes, args.students, args.early_s, trace=args.trace)
    if args.trace:
        report["trace"] = trace_summary(args.trace)
        print(f"trace: {report['trace']}")
    checks = report["checks"]
    run_record = {"when": started, "args": {"minutes": args.minutes, "students": args.students, "early_s": args.early_s}, **report}
    runs = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps(runs + [run_record], indent=1, ensure_ascii=False) + "\n")
    heap, long = report["heap_mb"], report["long_tasks"]
    print(f"\nlongest main-thread task {long['max']:.0f} ms ({long['n']} over 50 ms, {long['over200']} over 200 ms; top {long['top']})")
    print(f"heap after GC: {heap['early']} MB at {args.early_s:.0f} s, {heap['end']} MB at the end "
          f"({heap['end'] / heap['early']:.2f}x)" if heap["early"] else f"heap: {heap}")
    print(f"finals sent {report['sent'].get('transcript', 0)}, counted {report['counted']} "
          f"(caught up {report['caught_up_after_end_s']} s after the end); DOM {report['dom_nodes_end']} nodes")
    late = report["late_dashboard"]
    print(f"a dashboard opened after the joins listed \"{late['students']}\" in {late['listed_s']} s, "
          f"longest task {late['long_tasks']['max']:.0f} ms")
    print(f"question groups: {checks['groups']['groups']} found, {checks['groups']['shown']} shown, newest first: "
          f"{checks['groups']['newest_shown']}, counts right: {not checks['groups']['wrong']}; top {checks['groups']['top'][:3]}")
    failed = [k for k, v in checks.items() if k != "groups" and not v]
    print("must show: " + ("all hold" if not failed else "FAILED " + ", ".join(failed)) + f"; appended to {args.out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
