"""Issue 17 with a real Chromium student: the page keeps its microphone audio and, after a break,
sends what the server had not acknowledged, so that nothing it said is lost or shown twice.

A 48 s track of eight sentences is spoken through the page's fake microphone against a real
`serve --redis-url` (STREAMSERVER_SECRET set, tiny.en), read off the teacher's dashboard:
- three times without a break (the words each sentence gets wrong without a break: see BASELINE_RUNS),
- with the server SIGKILLed at 14 s and started again at 19 s on the same port,
- with the student's network dropped for 10 s at 14 s (iptables: every UDP datagram on loopback,
  which carries the WebRTC session, and the TCP port of the server, which carries the page's
  reconnect attempts; root only).
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import aiohttp
import pytest

from streamserver.loadsim.clients import create_room, speech_file
from tests.recovery_track import errors_over, match_sentences, sentence_errors, track, wer
from tests.server_process import ADMIN_TOKEN, ServerProcess, free_port
from tests.system_packages import needs_system
from tests.test_browser import CHROMIUM, NEEDS_CHROMIUM, _chromium_flags

pytestmark = NEEDS_CHROMIUM

BREAK_AT_S = 14.0  # into the track, as the scenario
SERVER_BACK_S = 5.0  # a killed server is started again this much later
BLIP_S = 10.0


def _lesson(url: str, tmp_path: Path, mic: Path, expected: int, at_break: Callable[[], None] | None) -> tuple[list[str], list[str]]:
    """The track spoken by Alice's page; `at_break` runs BREAK_AT_S after she is connected (in a
    thread). The dashboard's finals of Alice (texts) when all came, or after the track + 90 s,
    and the student page's status lines seen."""
    from playwright.sync_api import sync_playwright

    async def make_room() -> dict:
        async with aiohttp.ClientSession() as s:
            return await create_room(s, url, ADMIN_TOKEN, "Recovery class")

    room = asyncio.run(make_room())
    statuses: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(str(tmp_path / f"profile-{time.monotonic_ns()}"),
                                                       executable_path=CHROMIUM, headless=True, args=_chromium_flags(mic))
        try:
            teacher, student = browser.new_page(), browser.new_page()
            student.on("console", lambda m: statuses.append(f"console: {m.text}"))
            teacher.goto(room["teacher_url"])
            teacher.locator("#feed-status", has_text="live").wait_for(timeout=15000)
            student.goto(room["student_url"] + "&name=Alice")
            student.click("#join")
            student.locator("#status", has_text="connected").wait_for(timeout=20000)
            started = time.time()
            breaker = threading.Timer(BREAK_AT_S, at_break) if at_break else None
            if breaker:
                breaker.start()
            texts: list[str] = []
            last = ""
            while time.time() < started + 48 + 90:
                status = student.text_content("#status") or ""
                if status != last:
                    last = status
                    statuses.append(f"{time.time() - started:.1f}: {status}")
                texts = teacher.eval_on_selector_all('.transcript:not(.partial)[data-student-name="Alice"] .text',
                                                     "els => els.map(e => e.textContent)")
                if len(texts) >= expected and time.time() > started + 48:
                    time.sleep(3)  # anything more (a copy) would come now
                    texts = teacher.eval_on_selector_all('.transcript:not(.partial)[data-student-name="Alice"] .text',
                                                         "els => els.map(e => e.textContent)")
                    break
                time.sleep(0.25)
            if breaker:
                breaker.join()
        finally:
            browser.close()
    return texts, statuses


@pytest.fixture(scope="module")
def lesson_track(tmp_path_factory) -> tuple[Path, list[str]]:
    audio, texts, _starts = track()
    return speech_file(tmp_path_factory.mktemp("track") / "lesson.wav", audio, lead_s=0.5, tail_s=1.0), texts


# Runs of the track without any break, to compare with. The same track through the page gives
# 2.1 %, 4.2 % or 6.3 % WER (2, 4 or 6 of its 95 words) from run to run, because the RTP stream
# starts at a different point of the microphone's audio each time, so the VAD's frames and the
# utterances' edges fall elsewhere and tiny.en flips the same few words: "his" / "its" in the
# first sentence, "ill disposed" / "old-sposed" in the second and third (2 words each, often both
# at once). These flips alone exceed a 2-point margin (1.9 words) against one run without a
# break, and a sentence-by-sentence count against three runs when the flip moves from one
# sentence to another. So what a break run may get wrong beyond what the runs without a break get
# wrong is at most 2 points of the track, counted so that a flip seen without a break is not taken
# for the break's cost (errors_over): the margin, measured against the words a break can
# cost.
BASELINE_RUNS = 3
BASELINE_STAGGER_S = 15.0  # past a lesson's start (server, browser, pages, connection: 5-10 s here)
MARGIN = 0.02
# Each sentence on its own (errors_over's per_sentence): a flip that moves makes one sentence
# 2 words worse than every run without a break ("ill disposed" in the second or third), and the
# margin's 1.9 words leave a break 1 whole word, so 3 words over in a sentence is what the flips
# and the margin allow together. Four is a loss that the other sentences' luck must not hide:
# half to two thirds of one of this track's shortest sentences (6 to 8 words).
SENTENCE_MARGIN = 3


@pytest.fixture(scope="module")
def baseline(redis_url, tmp_path_factory, lesson_track) -> list[list[int]]:
    """Words wrong per sentence in each of BASELINE_RUNS runs of the track without any break.
    The runs overlap (a server and a browser each, one thread each: Playwright's sync API is per
    thread): they are independent, and the track plays in real time whatever the CPU does, so
    one after the other would only take three times as long. Each starts BASELINE_STAGGER_S
    after the one before: three servers and browsers starting at once on 2 cores delay the
    pages' connections enough to change how the track's first sentences are heard."""
    mic, texts = lesson_track

    def run(index: int, folder: Path) -> list[str]:
        time.sleep(index * BASELINE_STAGGER_S)
        with ServerProcess("--redis-url", redis_url) as server:
            heard, _ = _lesson(server.url, folder, mic, len(texts), None)
        return heard

    with ThreadPoolExecutor(BASELINE_RUNS) as pool:
        heards = list(pool.map(run, range(BASELINE_RUNS), [tmp_path_factory.mktemp("baseline") for _ in range(BASELINE_RUNS)]))
    runs = []
    for heard in heards:
        assert match_sentences(texts, heard) == list(range(len(texts))), heard
        print(f"without a break: WER {wer(texts, heard):.3f}, heard {heard}")
        runs.append(sentence_errors(texts, heard))
    return runs


def test_a_server_killed_and_restarted_loses_no_sentence(redis_url, tmp_path, lesson_track, baseline):
    mic, texts = lesson_track
    port = free_port()
    servers = [ServerProcess("--redis-url", redis_url, port=port)]

    def crash() -> None:
        servers[0].proc.send_signal(signal.SIGKILL)
        servers[0].proc.wait(10)
        time.sleep(SERVER_BACK_S)
        servers.append(ServerProcess("--redis-url", redis_url, port=port))

    try:
        heard, statuses = _lesson(servers[0].url, tmp_path, mic, len(texts), crash)
    finally:
        for server in servers:
            server.stop()
    print(f"with the crash: WER {wer(texts, heard):.3f}, heard {heard}; words wrong per sentence {sentence_errors(texts, heard)}, "
          f"without a break {baseline}; page said {statuses}")
    assert any("your speech is kept" in s for s in statuses), statuses
    assert match_sentences(texts, heard) == list(range(len(texts))), heard  # each once, in order
    assert errors_over(texts, heard, baseline, per_sentence=SENTENCE_MARGIN) <= MARGIN


BLIP_TAG = "streamserver-blip-test"


def _remove_blip_rules() -> None:
    listed = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        if BLIP_TAG in line and line.startswith("-A "):
            subprocess.run(["iptables", "-D", *line.split()[1:]], capture_output=True)


def _iptables(*rule: str) -> None:
    subprocess.run(["iptables", *rule], check=True, capture_output=True)


IPTABLES = shutil.which("iptables")


def _can_block() -> bool:
    """Whether the installed iptables takes rules from this process (root's only)."""
    try:
        _iptables("-L", "INPUT", "-n")
    except (subprocess.CalledProcessError, OSError):
        return False
    return True


@needs_system("iptables", None if IPTABLES else "iptables is not installed (make test installs it)")
@pytest.mark.skipif(IPTABLES is not None and not _can_block(), reason="blocking the page's traffic with iptables needs root")
def test_a_ten_second_network_blip_loses_no_sentence(redis_url, tmp_path, lesson_track, baseline):
    mic, texts = lesson_track
    _remove_blip_rules()  # left behind by a run that was killed mid-blip
    with ServerProcess("--redis-url", redis_url) as server:
        tag = ["-m", "comment", "--comment", BLIP_TAG]  # so that a later run can find and remove them
        rules = [["INPUT", "-i", "lo", "-p", "udp", *tag, "-j", "DROP"],
                 ["INPUT", "-i", "lo", "-p", "tcp", "--dport", str(server.port), *tag, "-j", "DROP"]]

        def blip() -> None:
            for rule in rules:
                _iptables("-I", *rule)
            try:
                time.sleep(BLIP_S)
            finally:
                for rule in rules:
                    _iptables("-D", *rule)

        try:
            heard, statuses = _lesson(server.url, tmp_path, mic, len(texts), blip)
        finally:
            for rule in rules:  # never left behind, whatever failed
                while subprocess.run(["iptables", "-D", *rule], capture_output=True).returncode == 0:
                    pass
    print(f"with the blip: WER {wer(texts, heard):.3f}, heard {heard}; words wrong per sentence {sentence_errors(texts, heard)}, "
          f"without a break {baseline}; page said {statuses}")
    assert any("your speech is kept" in s for s in statuses), statuses
    assert match_sentences(texts, heard) == list(range(len(texts))), heard
    assert errors_over(texts, heard, baseline, per_sentence=SENTENCE_MARGIN) <= MARGIN
