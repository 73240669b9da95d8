"""A real Chromium student (fake microphone fed from a speech file) and a real teacher dashboard
page, against a real `streamserver serve` routing through a real Redis."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.scoring import wer
from streamserver.loadsim.clients import create_room, speech_file
from tests.server_process import ADMIN_TOKEN, ServerProcess
from tests.system_packages import needs_system

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "dashboard.png"

NEEDS_CHROMIUM = needs_system("chromium", None if Path(CHROMIUM).exists() else "Debian chromium is not installed (make test installs it)")
pytestmark = NEEDS_CHROMIUM


def _chromium_flags(fake_mic: Path) -> list[str]:
    return [
        "--no-sandbox", "--disable-gpu", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={fake_mic}%noloop", "--allow-loopback-in-peer-connection",
        "--disable-features=WebRtcHideLocalIpsWithMdns", "--disable-background-networking", "--no-first-run",
        "--disable-component-update", "--disable-sync",
    ]


def _make_room(server: ServerProcess, name: str) -> dict:
    async def make() -> dict:
        async with aiohttp.ClientSession() as s:
            return await create_room(s, server.url, ADMIN_TOKEN, name)

    return asyncio.run(make())


def _launch(playwright, tmp_path: Path, mic: Path):  # noqa: ANN001, ANN202 - Playwright's own types
    """Debian's Chromium with a fake microphone playing `mic` once."""
    return playwright.chromium.launch_persistent_context(
        str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=_chromium_flags(mic)
    )


def test_browser_student_to_teacher_dashboard_through_redis(redis_url, tmp_path, librivox):
    from playwright.sync_api import sync_playwright

    from engines.audio import load_audio

    question = Path(__file__).parent / "data" / "flite" / "flite_1.wav"
    clips = [*((a, r) for _, a, r in librivox[:2]), (load_audio(question), question.with_suffix(".txt").read_text().strip())]
    gap = np.zeros(int(1.5 * 16000), np.float32)
    mic = speech_file(tmp_path / "speech.wav", np.concatenate([part for a, _ in clips for part in (a, gap)]))
    reference = " ".join(r for _, r in clips)

    with ServerProcess("--redis-url", redis_url) as server:
        room = _make_room(server, "Year 7 science")
        with sync_playwright() as p:
            browser = _launch(p, tmp_path, mic)
            # The pages run under the server's CSP (no eval: Playwright's string predicates would
            # break it, so the waits use locators); nothing may violate it, and no request of
            # theirs may carry a Referer (the links' tokens live in the fragment anyway).
            violations: list[str] = []
            referers: list[str] = []
            teacher = browser.new_page()
            student = browser.new_page()
            for page in (teacher, student):
                page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
                page.on("request", lambda r: referers.append(r.headers["referer"]) if r.headers.get("referer") else None)
            page_response = teacher.goto(room["teacher_url"])
            assert "frame-ancestors 'none'" in page_response.headers["content-security-policy"]
            teacher.locator("#feed-status", has_text="live").wait_for(timeout=15000)
            student.goto(room["student_url"] + "&name=Alice")  # the name joins the fragment
            assert student.input_value("#name") == "Alice"
            student.click("#join")
            student.locator("#status", has_text="connected").wait_for(timeout=20000)
            deadline = time.time() + 60
            texts: list[str] = []
            captioned: dict[str, str] = {}  # utterance id -> its live caption's text, seen while Alice spoke
            while time.time() < deadline:
                for uid, text in teacher.eval_on_selector_all(
                    '.transcript.partial[data-student-name="Alice"]', "els => els.map(e => [e.dataset.utteranceId, "
                    "e.querySelector('.text').textContent])"
                ):
                    captioned.setdefault(uid, text)
                texts = teacher.eval_on_selector_all(
                    '.transcript:not(.partial)[data-student-name="Alice"] .text', "els => els.map(e => e.textContent)"
                )
                if wer([reference], [" ".join(texts)]) <= 0.15 and len(texts) >= len(clips):
                    break
                time.sleep(0.2)
            finals = teacher.eval_on_selector_all('.transcript:not(.partial)', "els => els.map(e => e.dataset.utteranceId)")
            partial_now = teacher.eval_on_selector_all('.transcript.partial', "els => els.map(e => e.dataset.utteranceId)")
            SCREENSHOT.parent.mkdir(exist_ok=True)
            teacher.screenshot(path=str(SCREENSHOT), full_page=True)
            latencies = teacher.eval_on_selector_all(".transcript:not(.partial) .latency", "els => els.map(e => e.textContent)")
            # Alice's question is a group of one; the teacher's "Answered" reaches the server,
            # whose question_group_answered event marks it on the dashboard (each of the room's).
            group = teacher.locator(".question-group", has_text="proof")
            group.wait_for(timeout=15000)
            assert group.locator(".group-count").text_content() == "1"
            group.locator(".group-answer").click()
            teacher.locator(".question-group.answered", has_text="proof").wait_for(timeout=10000)
            browser.close()

    # Chromium honoured the answer's usedtx=1 (transport/dtx.py): in the gaps it sent DTX packets.
    ended = [line for line in server.log.read_text().splitlines() if "WebRTC audio stream ended" in line]
    assert ended and int(ended[-1].split("(")[1].split()[0]) > 0, ended
    assert not violations, violations
    assert not referers, referers

    assert texts, "no transcript reached the dashboard"
    assert wer([reference], [" ".join(texts)]) <= 0.15, texts
    assert latencies and all(t.endswith(" s") for t in latencies)
    # Live captions: the long first clip showed as a provisional line that its final replaced
    # (same utterance, same place: no partial left for a finalised utterance).
    assert captioned, "no live caption was seen while Alice spoke"
    assert set(captioned) & set(finals), (captioned, finals)
    assert not set(partial_now) & set(finals), partial_now

    async def stored() -> list[dict]:
        import redis.asyncio as aioredis

        r = aioredis.from_url(redis_url)
        entries = await r.xrange(f"room:{room['room_id']}:history")
        await r.aclose()
        return [json.loads(f[b"event"]) for _, f in entries]

    in_redis = [e for e in asyncio.run(stored()) if e["type"] == "transcript"]
    assert [e["student_name"] for e in in_redis] == ["Alice"] * len(in_redis) and len(in_redis) == len(texts)
    for event in in_redis:  # every transcript carries its intent: a label (or null) and a score
        assert set(event["intent"]) == {"label", "score"} and 0.0 <= event["intent"]["score"] <= 1.0


def test_a_duplicated_tab_stops_the_older_one_instead_of_fighting_for_the_seat(tmp_path, librivox):
    """A browser copies a tab's sessionStorage into its duplicate, so both tabs hold the same
    student identity: the newer one's join replaces the older one's peer. The older page is told
    why on its recovery channel and stops with a message; before, it took the closed peer for a
    network break, reconnected, replaced the newer tab, and so on, every few seconds."""
    from playwright.sync_api import sync_playwright

    audio = librivox[0][1]
    mic = speech_file(tmp_path / "speech.wav", np.concatenate([audio, np.zeros(40 * 16000, np.float32)]))
    with ServerProcess() as server:
        room = _make_room(server, "two tabs")
        with sync_playwright() as p:
            browser = _launch(p, tmp_path, mic)
            first, second = browser.new_page(), browser.new_page()
            first.goto(room["student_url"] + "&name=Tess")
            first.click("#join")
            first.locator("#status", has_text="connected").wait_for(timeout=20000)
            key = f"streamserver:identity:{room['room_id']}"
            identity = first.evaluate("k => sessionStorage.getItem(k)", key)
            assert identity, "the page keeps its identity in sessionStorage"
            second.goto(room["student_url"] + "&name=Tess")
            second.evaluate("([k, v]) => sessionStorage.setItem(k, v)", [key, identity])  # what "Duplicate tab" does
            second.click("#join")
            second.locator("#status", has_text="connected").wait_for(timeout=20000)
            first.locator("#status", has_text="another tab").wait_for(timeout=10000)
            time.sleep(8)  # longer than the older page's first reconnect would have waited (1 s, then 2, 4)
            older, newer = first.text_content("#status"), second.text_content("#status")
            browser.close()
    assert "another tab" in older, older
    assert "connected" in newer and "reconnect" not in newer, newer
    ended = [line for line in server.log.read_text().splitlines() if "WebRTC audio stream ended" in line]
    assert len(ended) <= 2, ended  # the older tab's peer once, the newer's at the browser's close: no fight
