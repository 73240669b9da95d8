"""The live server end to end: a real `streamserver serve`, real aiortc students, real Redis."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import pytest

from benchmarks.scoring import wer
from streamserver.loadsim.clients import Dashboard, admin_headers, create_room, join_student, speech_file, token_of
from streamserver.rooms import tokens
from tests.server_process import ADMIN_TOKEN, ServerProcess


@pytest.fixture(scope="module")
def small_server():
    with ServerProcess("--max-students", "2") as server:
        yield server


def test_room_api_and_bad_input_answers(small_server):
    async def scenario() -> None:
        url = small_server.url
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/api/rooms", json={"name": "a", "language": "en"}) as r:
                assert r.status == 401
            async with s.post(f"{url}/api/rooms", json={"name": "a"}, headers={"Authorization": "Bearer nope"}) as r:
                assert r.status == 401
            async with s.post(f"{url}/api/rooms", data="{not json", headers=admin_headers(ADMIN_TOKEN)) as r:
                assert r.status == 400 and "JSON" in (await r.json())["error"]
            async with s.post(f"{url}/api/rooms", json={"name": "a", "language": "fr"}, headers=admin_headers(ADMIN_TOKEN)) as r:
                assert r.status == 400
            async with s.post(f"{url}/api/rooms", json={"name": "a", "language": "zh"}, headers=admin_headers(ADMIN_TOKEN)) as r:
                assert r.status == 400 and "English-only" in (await r.json())["error"]
            a, b = await create_room(s, url, ADMIN_TOKEN, "A"), await create_room(s, url, ADMIN_TOKEN, "B")
            offer_a = f"{url}/api/rooms/{a['room_id']}/offer"
            student_a, teacher_a = token_of(a["student_url"]), token_of(a["teacher_url"])
            good = {"token": student_a, "type": "offer", "student_name": "Ann", "sdp": "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n"}
            async with s.post(offer_a, json={**good, "token": student_a[:-3] + "xyz"}) as r:
                assert r.status == 401
            for odd in (5, None, ["a"], {"t": 1}):  # not even a string: still a clear 401
                async with s.post(offer_a, json={**good, "token": odd}) as r:
                    assert r.status == 401
            async with s.post(offer_a, json={**good, "token": teacher_a}) as r:
                assert r.status == 403  # a teacher token is not a student token
            async with s.post(offer_a, json={**good, "token": token_of(b["student_url"])}) as r:
                assert r.status == 403  # a token of room B never opens room A
            async with s.post(offer_a, json=good) as r:
                assert r.status == 400 and "offer" in (await r.json())["error"]  # malformed SDP
            async with s.post(offer_a, data=b"x" * 200_000, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 413
            async with s.post(f"{url}/api/rooms/nosuchroom/offer", json=good) as r:
                assert r.status == 403  # room A's link says nothing of whether another room exists
            unknown = tokens.issue(small_server.secret, "nosuchroom", "student", 60)
            async with s.post(f"{url}/api/rooms/nosuchroom/offer", json={**good, "token": unknown}) as r:
                assert r.status == 404  # a valid link of a room that is gone
            feed = url.replace("http", "ws") + f"/api/rooms/{a['room_id']}/feed?token={student_a}"
            with pytest.raises(aiohttp.WSServerHandshakeError) as denied:
                await s.ws_connect(feed)
            assert denied.value.status == 403  # a student token never opens the dashboard feed
            async with s.get(f"{url}/healthz") as r:
                assert r.status == 200 and (await r.json())["ok"]

    asyncio.run(scenario())


def test_without_a_valid_token_a_room_that_exists_and_one_that_does_not_answer_alike(small_server):
    """The routes of a room check the token against the path's room id before they look the room
    up: a caller without one learns nothing of which rooms exist (and costs no Redis call)."""
    async def answers(s: aiohttp.ClientSession, room_id: str) -> list[int]:
        base = f"{small_server.url}/api/rooms/{room_id}"
        out = []
        for token in (None, "forged"):
            body = {"sdp": "v=0\r\n", "type": "offer", **({"token": token} if token else {})}
            async with s.post(f"{base}/offer", json=body) as r:
                out.append(r.status)
            params = {"token": token} if token else {}
            async with s.get(f"{base}/feed", params=params) as r:
                out.append(r.status)
            async with s.get(f"{base}/transcript", params=params) as r:
                out.append(r.status)
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with s.delete(base, headers=headers) as r:
                out.append(r.status)
        return out

    async def scenario() -> tuple[list[int], list[int]]:
        async with aiohttp.ClientSession() as s:
            room = await create_room(s, small_server.url, ADMIN_TOKEN, "exists")
            return await answers(s, room["room_id"]), await answers(s, "nosuchroom")

    known, unknown = asyncio.run(scenario())
    assert known == unknown, (known, unknown)
    assert set(known) <= {401, 403}, known


def test_room_full_is_429(small_server, tmp_path, librivox):
    async def scenario() -> None:
        wav = speech_file(tmp_path / "s.wav", librivox[0][1][:16000])
        async with aiohttp.ClientSession() as s:
            room = await create_room(s, small_server.url, ADMIN_TOKEN, "full")
            peers = [await join_student(s, small_server.url, room, f"s{i}", wav) for i in range(2)]
            with pytest.raises(AssertionError, match="429"):
                await join_student(s, small_server.url, room, "third", wav)
            for pc in peers:
                await pc.close()

    asyncio.run(scenario())


def test_ten_students_through_redis_each_utterance_once(redis_url, tmp_path, librivox):
    """10+ concurrent aiortc students in one room: every clip transcribed exactly once, accurately,
    in the room's Redis history, and nothing of it reaches another room's dashboard."""

    async def scenario(server: ServerProcess) -> None:
        async with aiohttp.ClientSession() as s:
            room, other = await create_room(s, server.url, ADMIN_TOKEN, "big"), await create_room(s, server.url, ADMIN_TOKEN, "other")
            dashboard = await Dashboard().open(s, server.url, room)
            bystander = await Dashboard().open(s, server.url, other)
            students = {f"student{i:02d}": librivox[i % len(librivox)] for i in range(10)}
            peers = [
                await join_student(s, server.url, room, name, speech_file(tmp_path / f"{name}.wav", clip[1]))
                for name, clip in students.items()
            ]
            deadline = asyncio.get_running_loop().time() + 90
            while asyncio.get_running_loop().time() < deadline:
                heard = {t["student_name"] for t in dashboard.transcripts()}
                if heard == set(students):
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(3)  # anything late or duplicated would arrive now
            for pc in peers:
                await pc.close()
            transcripts = dashboard.transcripts()
            ids = Counter(t["utterance_id"] for t in transcripts)
            assert all(n == 1 for n in ids.values()), "an utterance was published twice"
            by_student = {name: " ".join(t["text"] for t in transcripts if t["student_name"] == name) for name in students}
            assert all(by_student.values()), f"silent students: {[n for n, t in by_student.items() if not t]}"
            refs = [students[name][2] for name in students]
            assert wer(refs, [by_student[name] for name in students]) <= 0.15
            for t in transcripts:
                assert t["room_id"] == room["room_id"] and t["published_ts"] >= t["end_of_speech_ts"] >= t["start_ts"]
                assert set(t["intent"]) == {"label", "score"}
            assert not bystander.transcripts()
            await dashboard.close()
            await bystander.close()
            # The room's capped history in Redis holds the same transcripts.
            import redis.asyncio as aioredis

            r = aioredis.from_url(redis_url)
            stored = [json.loads(f[b"event"]) for _, f in await r.xrange(f"room:{room['room_id']}:history")]
            await r.aclose()
            assert {e["utterance_id"] for e in stored if e["type"] == "transcript"} == set(ids)

    with ServerProcess("--redis-url", redis_url) as server:
        asyncio.run(scenario(server))


def test_reconnect_keeps_the_student_and_history_replays(small_server, tmp_path, librivox):
    """A student that drops and comes back with its id keeps its seat (no second join); a
    dashboard that connects later gets the room's history."""

    async def scenario() -> None:
        url = small_server.url
        wav = speech_file(tmp_path / "s.wav", librivox[1][1])
        async with aiohttp.ClientSession() as s:
            room = await create_room(s, url, ADMIN_TOKEN, "reconnect")
            first = await Dashboard().open(s, url, room)
            pc = await join_student(s, url, room, "Bo", wav)
            await asyncio.sleep(1.0)
            await pc.close()  # network drop
            again = await join_student(s, url, room, "Bo", wav, identity=pc.identity)
            assert again.student_id == pc.student_id
            for _ in range(60):
                if first.transcripts():
                    break
                await asyncio.sleep(0.5)
            await again.close()
            late = await Dashboard().open(s, url, room)
            await asyncio.sleep(0.5)
            joins = [e for e in first.events if e["type"] == "student_joined"]
            assert [e["student_id"] for e in joins] == [pc.student_id]
            assert first.transcripts(), "the reconnected student was not transcribed"
            replayed = [e for e in late.history if e["type"] == "transcript"]
            assert {e["utterance_id"] for e in replayed} == {t["utterance_id"] for t in first.transcripts()}
            await first.close()
            await late.close()

    asyncio.run(scenario())
