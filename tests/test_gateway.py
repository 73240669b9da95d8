"""`streamserver gateway` + `streamserver worker` processes around a real redis-server: the busy
answer when no worker can transcribe, and a small simulated class end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.server_process import ADMIN_TOKEN, free_port

# One secret for every gateway: a token signed by one is checked by another.
ENV = dict(os.environ, STREAMSERVER_ADMIN_TOKEN=ADMIN_TOKEN, STREAMSERVER_SECRET="test-gateways-secret", PYTHONUNBUFFERED="1")


def _get(url: str, headers: dict | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _wait(url: str, timeout_s: float = 120, answer_s: float = 1) -> None:
    """Until `url` answers 200 (each try waiting answer_s for the answer)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=answer_s):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


class Proc:
    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "streamserver", *args], env=ENV,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def pcm_of(audio, silence_s: float = 2.0) -> bytes:
    """A clip as PCM16 with silence after it, so that the VAD ends the utterance."""
    import numpy as np

    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes() + bytes(int(16000 * silence_s) * 2)


async def open_student(session, url: str, room: dict, name: str, student_id: str):
    """A WebSocket student of `room` through the gateway at `url`, after its "ready"."""
    from streamserver.loadsim.clients import token_of

    params = {"token": token_of(room["student_url"]), "name": name, "student_id": student_id}
    ws = await session.ws_connect(url.replace("http", "ws") + "/ws/ingest", params=params)
    assert json.loads((await ws.receive(timeout=10)).data)["type"] == "ready"
    return ws


async def say(ws, pcm: bytes) -> None:
    import asyncio

    for i in range(0, len(pcm), 6400):  # 200 ms a message, a little faster than real time
        await ws.send_bytes(pcm[i : i + 6400])
        await asyncio.sleep(0.15)


async def transcripts(dashboard, n: int, timeout_s: float = 60) -> list[dict]:
    import asyncio

    for _ in range(int(timeout_s * 10)):
        found = [e for e in dashboard.events if e.get("type") == "transcript"]
        if len(found) >= n:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"{n} transcripts expected, got {[e.get('type') for e in dashboard.events]}")


@pytest.fixture()
def gateway(redis_url, tmp_path):
    port = free_port()
    proc = Proc(tmp_path / "gateway.log", "gateway", "--port", str(port), "--redis-url", redis_url)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url + "/healthz", 60)
        yield url
    finally:
        proc.stop()


def test_no_worker_means_busy_not_a_silent_queue(gateway):
    status, body = _get(gateway + "/readyz")
    assert status == 503 and "no ASR worker" in body
    status, room = _post(gateway + "/api/rooms", {"name": "busy class", "language": "en"},
                         {"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 201, room
    # A gateway has no engine of its own: a Mandarin room is the workers' business.
    status, zh_room = _post(gateway + "/api/rooms", {"name": "中文课", "language": "zh"}, {"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 201, zh_room
    from streamserver.loadsim.clients import token_of

    token = token_of(room["student_url"])
    status, answer = _post(f"{gateway}/api/rooms/{room['room_id']}/offer",
                           {"sdp": "v=0", "type": "offer", "token": token, "student_name": "Ann"})
    assert status == 503 and answer["error"] == "busy" and "no ASR worker" in answer["detail"]
    status, metrics = _get(gateway + "/metrics", {"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 200 and "streamserver_busy_rejections_total 1.0" in metrics
    assert "streamserver_queue_depth" in metrics


def test_small_class_through_gateway_and_worker(gateway, redis_url, tmp_path):
    """3 students over WebSocket for 20 s; one worker process: every queued utterance comes back
    once, and the worker's metrics saw the batches."""
    mport = free_port()
    worker = Proc(tmp_path / "worker.log", "worker", "--redis-url", redis_url, "--threads", "2",
                  "--name", "test-worker", "--metrics-port", str(mport))
    try:
        _wait(f"http://127.0.0.1:{mport}/readyz", 180)
        run = subprocess.run(
            [sys.executable, "-m", "streamserver", "loadsim", "--url", gateway, "--students", "3", "--rooms", "1",
             "--duration", "20", "--speak-ratio", "0.3", "--transport", "ws", "--report", str(tmp_path / "report")],
            env=ENV, capture_output=True, text=True, timeout=180,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        report = json.loads((tmp_path / "report" / "report.json").read_text())
        assert report["utterances_queued"] > 0 and report["transcripts_received"] == report["utterances_queued"]
        assert report["never_queued"] == 0 and report["lost_vs_queued"] == 0  # the gateway announced every clip's utterance
        assert report["lost"] == 0 and report["duplicates"] == 0
        status, metrics = _get(f"http://127.0.0.1:{mport}/metrics")
        assert status == 200 and "streamserver_batch_size_count" in metrics
        # A final published from its speculation when the hangover ends is the gateway's (its sink
        # publishes it); every other one the worker's: between them, every transcript.
        status, gateway_metrics = _get(gateway + "/metrics", {"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert status == 200
        counts = [float(line.split()[-1]) for text in (metrics, gateway_metrics) for line in text.splitlines()
                  if line.startswith("streamserver_eos_to_published_seconds_count")]
        assert len(counts) == 2 and sum(counts) >= report["transcripts_received"]
    finally:
        worker.stop()


def test_redis_restart_gateway_and_worker_reconnect(tmp_path, librivox):
    """Redis (append-only file) restarts between two utterances of a student: the gateway and
    the worker reconnect by themselves, the dashboard's feed resubscribes, both transcripts
    arrive once."""
    import asyncio

    import aiohttp

    from streamserver.loadsim.clients import Dashboard, create_room
    from tests.redis_server import RedisServer

    server = RedisServer(persist_dir=tmp_path / "aof").start()
    port, mport = free_port(), free_port()
    gateway = Proc(tmp_path / "gateway.log", "gateway", "--port", str(port), "--redis-url", server.url)
    worker = Proc(tmp_path / "worker.log", "worker", "--redis-url", server.url, "--threads", "2", "--metrics-port", str(mport))
    url = f"http://127.0.0.1:{port}"
    pcm = pcm_of(librivox[0][1])

    async def body() -> None:
        async with aiohttp.ClientSession() as session:
            room = await create_room(session, url, ADMIN_TOKEN, "restart class", "en")
            dashboard = await Dashboard().open(session, url, room)
            async with await open_student(session, url, room, "Ann", "ann-0001") as ws:
                await say(ws, pcm)
                await transcripts(dashboard, 1)
                server.stop()  # SIGTERM: the AOF is written out
                await asyncio.sleep(1.0)
                server.start()
                await asyncio.sleep(2.0)  # let the feed resubscribe (it backs off up to a few seconds)
                await say(ws, pcm)
                events = await transcripts(dashboard, 2)
            assert len({e["utterance_id"] for e in events}) == 2 and all(e["text"] for e in events)
            if dashboard.ws is not None:
                await dashboard.ws.close()

    try:
        _wait(url + "/healthz", 60)
        _wait(f"http://127.0.0.1:{mport}/readyz", 180)
        asyncio.run(asyncio.wait_for(body(), 180))
    finally:
        worker.stop()
        gateway.stop()
        server.stop()


def test_a_room_created_on_one_gateway_is_served_by_another(redis_url, tmp_path, librivox):
    """Two gateways, one worker: the room is created through gateway A, its student speaks
    through gateway B, the teacher watches on A."""
    import asyncio

    import aiohttp

    from streamserver.loadsim.clients import Dashboard, create_room

    ports = [free_port(), free_port()]
    mport = free_port()
    gateways = [Proc(tmp_path / f"gateway-{p}.log", "gateway", "--port", str(p), "--redis-url", redis_url) for p in ports]
    worker = Proc(tmp_path / "worker.log", "worker", "--redis-url", redis_url, "--threads", "2", "--metrics-port", str(mport))
    a, b = (f"http://127.0.0.1:{p}" for p in ports)
    pcm = pcm_of(librivox[1][1])

    async def body() -> None:
        async with aiohttp.ClientSession() as session:
            room = await create_room(session, a, ADMIN_TOKEN, "shared class", "en")
            dashboard = await Dashboard().open(session, a, room)
            async with await open_student(session, b, room, "Bo", "bo-000001") as ws:
                await say(ws, pcm)
                await transcripts(dashboard, 1)
            kinds = [e.get("type") for e in dashboard.events]
            assert "student_joined" in kinds and kinds.count("transcript") == 1, kinds
            if dashboard.ws is not None:
                await dashboard.ws.close()

    try:
        for url in (a, b):
            _wait(url + "/healthz", 60)
        _wait(f"http://127.0.0.1:{mport}/readyz", 180)
        asyncio.run(asyncio.wait_for(body(), 180))
    finally:
        worker.stop()
        for g in gateways:
            g.stop()
