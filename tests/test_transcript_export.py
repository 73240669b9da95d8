"""The class transcript belongs to the teacher (issue 15): GET /api/rooms/<id>/transcript returns
every final of the class in the order spoken, as JSON, CSV or text, for the teacher's token only;
kept by the bus beside the capped history: in-process for `serve`, a Redis list written by the
worker's own once-per-utterance publication for a gateway."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time
import urllib.error
import urllib.request

import aiohttp
import redis

from streamserver.bus.keys import transcript_key
from streamserver.loadsim.clients import Dashboard, create_room, token_of
from tests.server_process import ADMIN_TOKEN, ServerProcess, free_port
from tests.test_gateway import Proc, _wait, gateway, open_student, pcm_of, say  # noqa: F401 - gateway: a fixture


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers.get_content_type(), r.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, "", error.read().decode()


async def _class(url: str, clips: list[bytes]) -> tuple[dict, list[dict]]:
    """One student says the clips; the room and the transcripts its dashboard showed."""
    async with aiohttp.ClientSession() as session:
        room = await create_room(session, url, ADMIN_TOKEN, "Physics 7b", "en")
        dashboard = await Dashboard().open(session, url, room)
        async with await open_student(session, url, room, "Ann, \"the\" student", "ann-0001") as ws:
            for pcm in clips:
                await say(ws, pcm)
            deadline = time.monotonic() + 60
            while len(dashboard.transcripts()) < len(clips) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        await dashboard.close()
        return room, dashboard.transcripts()


def _export(url: str, room: dict, fmt: str, role: str = "teacher") -> tuple[int, str, str]:
    token = token_of(room[f"{role}_url"])
    return _get(f"{url}/api/rooms/{room['room_id']}/transcript?format={fmt}&token={token}")


def test_serve_exports_the_whole_class_in_order_for_the_teacher(librivox):
    clips = [pcm_of(librivox[1][1]), pcm_of(librivox[4][1])]
    with ServerProcess() as server:
        room, shown = asyncio.run(_class(server.url, clips))
        assert len(shown) == 2
        status, kind, body = _export(server.url, room, "json")
        assert status == 200 and kind == "application/json"
        exported = json.loads(body)
        assert exported["room_name"] == "Physics 7b"
        assert [t["utterance_id"] for t in exported["transcripts"]] == [t["utterance_id"] for t in shown]  # as spoken
        assert [t["text"] for t in exported["transcripts"]] == [t["text"] for t in shown]

        status, kind, body = _export(server.url, room, "csv")
        rows = list(csv.DictReader(io.StringIO(body)))
        assert status == 200 and kind == "text/csv" and len(rows) == 2
        assert rows[0]["student_name"] == 'Ann, "the" student' and rows[0]["text"] == shown[0]["text"]  # quoted, not split
        assert rows[0]["start_time"].endswith("Z") and rows[0]["utterance_id"] == shown[0]["utterance_id"]

        status, kind, body = _export(server.url, room, "txt")
        lines = body.splitlines()
        assert status == 200 and kind == "text/plain" and lines[0].startswith("Class Physics 7b")
        assert [line.split("] ", 1)[1] for line in lines[2:]] == [f'Ann, "the" student: {t["text"]}' for t in shown]

        assert _export(server.url, room, "json", role="student")[0] == 403  # the students' link cannot read it
        assert _export(server.url, room, "pdf")[0] == 400
        assert _get(f"{server.url}/api/rooms/{room['room_id']}/transcript")[0] in (401, 403)  # no token

        # The class is over: the room is closed, and its transcript is still the teacher's (and an admin's).
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/api/rooms/{room['room_id']}", method="DELETE",
                                                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}), timeout=10)
        assert _get(f"{server.url}/api/rooms/{room['room_id']}/feed?token={token_of(room['teacher_url'])}")[0] == 403  # closed
        status, _, body = _export(server.url, room, "json")
        assert status == 200 and [t["text"] for t in json.loads(body)["transcripts"]] == [t["text"] for t in shown]
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        with urllib.request.urlopen(urllib.request.Request(f"{server.url}/api/rooms/{room['room_id']}/transcript?format=txt",
                                                           headers=admin), timeout=10) as r:
            assert r.status == 200 and len(r.read().decode().splitlines()) == 2 + len(shown)
        try:
            urllib.request.urlopen(urllib.request.Request(f"{server.url}/api/rooms/no-such-room/transcript", headers=admin), timeout=10)
            raise AssertionError("an unknown room's transcript was served")
        except urllib.error.HTTPError as error:
            assert error.code == 404
        token = token_of(room["teacher_url"])
        assert _get(f"{server.url}/api/rooms/no-such-room/transcript?token={token}")[0] == 403  # another room's token


def test_a_gateways_class_transcript_is_written_by_the_worker(gateway, redis_url, tmp_path, librivox):  # noqa: F811
    mport = free_port()
    worker = Proc(tmp_path / "worker.log", "worker", "--redis-url", redis_url, "--threads", "2", "--metrics-port", str(mport))
    try:
        _wait(f"http://127.0.0.1:{mport}/readyz", 180)
        room, shown = asyncio.run(_class(gateway, [pcm_of(librivox[1][1])]))
        status, _, body = _export(gateway, room, "json")
        assert status == 200 and [t["utterance_id"] for t in json.loads(body)["transcripts"]] == [shown[0]["utterance_id"]]
        client = redis.Redis.from_url(redis_url)
        try:
            assert client.ttl(transcript_key(room["room_id"])) > 24 * 3600  # kept, with its retention
        finally:
            client.close()
    finally:
        worker.stop()


def test_csv_cells_a_student_wrote_are_never_run_as_spreadsheet_formulas():
    from streamserver.rooms.transcript import render

    t = {"start_ts": 0.0, "end_of_speech_ts": 1.0, "student_name": '=HYPERLINK("http://x","y")', "student_id": "s1",
         "text": "-5 is the answer", "language": "en", "utterance_id": "u1"}
    rows = list(csv.reader(io.StringIO(render({"room_id": "r", "name": "c"}, [t, {**t, "student_name": "Ann", "text": "x = 5"}], "csv"))))
    assert rows[1][2] == '\'=HYPERLINK("http://x","y")' and rows[1][4] == "'-5 is the answer"
    assert rows[2][2] == "Ann" and rows[2][4] == "x = 5"  # only a leading sign makes a formula


def test_a_memory_bus_keeps_a_class_transcript_for_its_retention_after_its_last_final():
    from streamserver.bus.memory import MemoryBus

    now = [0.0]
    bus = MemoryBus(transcript_retention_s=100, clock=lambda: now[0])
    final = json.dumps({"type": "transcript", "utterance_id": "u1", "text": "hello"})

    async def scenario() -> list[list[str]]:
        await bus.publish("old", final)
        now[0] = 60.0
        await bus.publish("new", final)
        seen = [await bus.transcript("old")]
        now[0] = 101.0  # 101 s after old's last final, 41 s after new's
        seen += [await bus.transcript("old"), await bus.transcript("new")]
        return seen

    kept, gone, other = asyncio.run(scenario())
    assert kept == [final] and gone == [] and other == [final]


def _seconds(clock: str) -> float:
    """HH:MM:SS.mmm (webvtt-py's start_in_seconds drops the milliseconds)."""
    hours, minutes, seconds = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


async def _two_students(url: str, clips: list[bytes]) -> tuple[dict, list[dict]]:
    """Ann says the first clip, then Bo (whose name needs escaping in WebVTT) the second while
    Ann says the third: the finals overlap in time and come from two speakers."""
    async with aiohttp.ClientSession() as session:
        room = await create_room(session, url, ADMIN_TOKEN, "Subtitled class", "en")
        dashboard = await Dashboard().open(session, url, room)
        async with await open_student(session, url, room, "Ann", "ann-0001") as ann, \
                await open_student(session, url, room, "Bo <&> Li", "bo-0002") as bo:
            await say(ann, clips[0])
            await asyncio.gather(say(bo, clips[1]), say(ann, clips[2]))
            deadline = time.monotonic() + 90
            while len(dashboard.transcripts()) < len(clips) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        await dashboard.close()
        return room, dashboard.transcripts()


def test_a_recorded_class_exports_as_srt_and_webvtt_that_parse_with_every_final_once_in_order(librivox):
    import html

    import srt
    import webvtt

    clips = [pcm_of(librivox[1][1]), pcm_of(librivox[4][1]), pcm_of(librivox[2][1])]
    with ServerProcess() as server:
        room, shown = asyncio.run(_two_students(server.url, clips))
        assert len(shown) == 3 and {t["student_name"] for t in shown} == {"Ann", "Bo <&> Li"}
        spoken = sorted(shown, key=lambda t: (t["start_ts"], t["end_of_speech_ts"]))  # the order spoken
        zero = spoken[0]["start_ts"]  # the default origin: the class's first speech
        expected = [(t["start_ts"] - zero, t["end_of_speech_ts"] - zero, t["student_name"], t["text"]) for t in spoken]

        status, kind, body = _export(server.url, room, "srt")
        assert status == 200 and kind == "application/x-subrip"
        cues = list(srt.parse(body))
        assert len(cues) == len(expected)  # every final once
        for cue, (start, end, name, text) in zip(cues, expected):
            assert abs(cue.start.total_seconds() - start) <= 0.1 and abs(cue.end.total_seconds() - end) <= 0.1
            assert cue.content == f"{name}: {text}"
        assert [c.index for c in cues] == [1, 2, 3]

        status, kind, body = _export(server.url, room, "vtt")
        assert status == 200 and kind == "text/vtt"
        captions = list(webvtt.from_buffer(io.StringIO(body)))
        assert len(captions) == len(expected)
        for caption, (start, end, name, text) in zip(captions, expected):
            assert abs(_seconds(caption.start) - start) <= 0.1 and abs(_seconds(caption.end) - end) <= 0.1
            assert html.unescape(caption.voice) == name and html.unescape(caption.text) == text  # named, escaped

        # One student's subtitles, laid over a recording that began 10 s before the class's first speech.
        token = token_of(room["teacher_url"])
        bo_id = next(t["student_id"] for t in shown if t["student_name"] == "Bo <&> Li")  # the server issues ids
        status, _, body = _get(f"{server.url}/api/rooms/{room['room_id']}/transcript?format=srt&student={bo_id}"
                               f"&origin={zero - 10}&token={token}")
        bo = [e for e in expected if e[2] == "Bo <&> Li"]
        cues = list(srt.parse(body))
        assert status == 200 and [c.content for c in cues] == [f"{name}: {text}" for _, _, name, text in bo]
        assert abs(cues[0].start.total_seconds() - (bo[0][0] + 10)) <= 0.1
        assert _get(f"{server.url}/api/rooms/{room['room_id']}/transcript?format=vtt&origin=nan&token={token}")[0] == 400
        assert _export(server.url, room, "vtt", role="student")[0] == 403  # the teacher's, as every export
