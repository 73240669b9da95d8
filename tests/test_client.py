"""streamserver.client (issue 32): the README's example, taken from README.md as it stands, joins a
student from a WAV file and prints the teacher feed's transcript, against a real `serve`; a
student whose stream breaks mid-sentence reconnects as itself and sends what the server had not
acknowledged, and the sentence is transcribed once, whole; a feed that reconnects yields nothing
twice; the load simulator builds its join and feed requests with the client."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from streamserver import client
from streamserver.loadsim.clients import speech_file
from tests.recovery_track import wer
from tests.server_process import ADMIN_TOKEN, ServerProcess

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    """The python block of the README's "A Python client" section."""
    section = README.read_text().split("## A Python client", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


@pytest.fixture(scope="module")
def server():
    with ServerProcess() as running:
        yield running


def test_the_readme_example_joins_a_student_from_a_wav_and_prints_the_feeds_transcript(server, librivox, tmp_path):
    code = readme_example()
    assert len(code.splitlines()) <= 15 and "streamserver.client" in code
    (tmp_path / "example.py").write_text(code)
    _, audio, text = librivox[4]
    wav = speech_file(tmp_path / "question.wav", audio, lead_s=0.5, tail_s=0.5)
    room = asyncio.run(client.create_room(server.url, ADMIN_TOKEN, "Client class"))
    done = subprocess.run([sys.executable, str(tmp_path / "example.py"), room.student_url, room.teacher_url, str(wav)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Ann: "), done.stdout
    assert wer([text], [lines[0].removeprefix("Ann: ")]) <= 0.2, (text, lines)


def test_a_student_whose_stream_breaks_resends_what_was_not_acknowledged(server, librivox):
    _, audio, text = librivox[0]  # the longest clip: the break falls in its middle
    quiet = bytes(2 * 16000)  # 1 s
    pcm = quiet + (audio * 32767).astype("<i2").tobytes() + quiet
    half = len(pcm) // 4 * 2

    async def scenario() -> tuple[list[dict], client.Student, int]:
        room = await client.create_room(server.url, ADMIN_TOKEN, "Broken class")
        async with client.Feed(room.teacher_url) as feed:
            async with client.Student(room.student_url, "Bo") as bo:
                await bo.play(pcm[:half])
                # The server acknowledges the quiet before the sentence; the sentence in progress is not safe yet.
                assert 0.5 <= bo.acknowledged_s < half / 2 / 16000
                await bo._ws.close(code=client.CLOSE_BREAK)  # the network drops it mid-sentence: no goodbye
                await bo.play(pcm[half:])  # sent again on a new connection, then the rest
            finals = [t async for t in feed.transcripts(idle_s=8)]
            await feed._ws.close()  # the feed breaks: it reconnects, replays, and yields no final twice
            again = [t async for t in feed.transcripts(idle_s=3)]
        return finals, bo, len(again)

    finals, bo, replayed = asyncio.run(scenario())
    assert bo.reconnects == 1 and bo.closed_by_server is None
    assert {t["student_id"] for t in finals} == {bo.student_id}  # the same student after the break
    assert wer([text], [t["text"] for t in finals]) <= 0.2, (text, [t["text"] for t in finals])
    assert len({t["utterance_id"] for t in finals}) == len(finals)
    assert replayed == 0


def test_the_load_simulator_joins_and_reads_feeds_through_the_client():
    from streamserver.loadsim import clients, ws_student

    assert ws_student.ingest_params is client.ingest_params and ws_student.ingest_url is client.ingest_url
    assert clients.token_of is client.token_of and clients.feed_url is client.feed_url
    assert client.ingest_params("t", "Ann", "s1", "r1", catch_up=True) == {
        "token": "t", "name": "Ann", "student_id": "s1", "resume": "r1", "catch_up": "1"}
    assert client.ingest_params("t", "Ann", "s1") == {"token": "t", "name": "Ann"}  # no resume: a new student
