"""Logs with fields (issue 32): `serve` with STREAMSERVER_LOG_FORMAT=json logs one JSON object a
line; over a short class, the join and transcript lines carry `room_id` and `student_id` (and the
transcript line its `utterance_id`, every line after start the `gateway`) as fields a log system
filters on, and no token or secret appears anywhere in the log."""

from __future__ import annotations

import asyncio
import json
import os

from streamserver import client
from tests.server_process import ADMIN_TOKEN, ServerProcess

SECRET = "json-log-test-secret"


def test_a_short_classes_json_log_has_room_and_student_fields_and_no_token(librivox):
    _, audio, _ = librivox[4]
    pcm = bytes(16000) + (audio * 32767).astype("<i2").tobytes()  # 0.5 s of quiet first

    async def short_class(url: str) -> tuple[client.RoomLinks, client.Student, list[dict]]:
        room = await client.create_room(url, ADMIN_TOKEN, "Logged class")
        async with client.Feed(room.teacher_url) as feed:
            async with client.Student(room.student_url, "Ann") as ann:
                await ann.play(pcm)
            return room, ann, [t async for t in feed.transcripts(idle_s=8)]

    with ServerProcess(env={**os.environ, "STREAMSERVER_LOG_FORMAT": "json", "STREAMSERVER_SECRET": SECRET}) as server:
        room, ann, finals = asyncio.run(short_class(server.url))
    log = server.log.read_text()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert finals and lines

    (joined,) = [line for line in lines if line["message"] == "student joined over WebSocket"]
    assert joined["room_id"] == room.room_id and joined["student_id"] == ann.student_id and joined["gateway"]
    published = [line for line in lines if line["message"].startswith("transcript of utterance")]
    assert [(line["room_id"], line["student_id"], line["utterance_id"]) for line in published] == \
        [(room.room_id, ann.student_id, t["utterance_id"]) for t in finals]
    assert all(set(line) >= {"ts", "level", "logger", "message"} for line in lines)

    secrets = [client.token_of(room.teacher_url), client.token_of(room.student_url), ann.resume, ADMIN_TOKEN, SECRET]
    assert all(secrets) and not [s for s in secrets if s in log]  # in no message, field or other output
