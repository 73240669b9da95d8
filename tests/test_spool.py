"""The gateway's spool (issue 14): utterances the job queue cannot take while Redis is away are
written to disk, survive a gateway killed meanwhile, and are queued in order, each transcript
published once, when Redis is back."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import aiohttp
import numpy as np
import redis

from streamserver.bus.keys import history_key
from streamserver.events import Utterance, now
from streamserver.loadsim.clients import create_room
from streamserver.queue.spool import Spool
from tests.redis_server import RedisServer
from tests.server_process import ADMIN_TOKEN, free_port
from tests.test_gateway import Proc, _wait, open_student, pcm_of, say


def utterance(audio: np.ndarray) -> Utterance:
    t = now()
    return Utterance(uuid.uuid4().hex, "r1", "s1", "Ann", "en", audio, t - 1, t)


def test_a_spool_keeps_order_and_survives_a_reopen(tmp_path):
    spool = Spool(tmp_path)
    audio = (np.sin(np.arange(16000) / 7) * 0.5).astype(np.float32)
    first, second = utterance(audio), utterance(audio[:8000])
    spool.put(first)
    (tmp_path / "000000000099-deadbeef.tmp").write_bytes(b"half written")  # a crash mid-write
    again = Spool(tmp_path)  # a restarted gateway
    again.put(second)
    loaded = [again.load(p) for p in again.pending()]
    assert [u.utterance_id for u in loaded] == [first.utterance_id, second.utterance_id]
    assert np.abs(loaded[0].audio - audio).max() < 1e-4 and loaded[1].end_of_speech_ts == second.end_of_speech_ts
    again.remove(again.pending()[0])
    assert [p.name.split("-")[1] for p in again.pending()] == [f"{second.utterance_id}.utt"]


def test_spooled_utterances_outlive_redis_and_the_gateway(tmp_path, librivox):
    """Redis goes away while a student speaks two clips: both are spooled; the gateway is then
    SIGKILLed; Redis comes back and a new gateway on the same spool queues them: the room's
    history gets each transcript once."""
    server = RedisServer(persist_dir=tmp_path / "aof").start()
    spool_dir, port, mport = tmp_path / "spool", free_port(), free_port()
    gateway_args = ("gateway", "--port", str(port), "--redis-url", server.url, "--spool-dir", str(spool_dir))
    gateway = Proc(tmp_path / "gateway.log", *gateway_args)
    url = f"http://127.0.0.1:{port}"
    clips = [pcm_of(librivox[0][1]), pcm_of(librivox[3][1])]

    async def speak_while_redis_is_down() -> dict:
        async with aiohttp.ClientSession() as session:
            room = await create_room(session, url, ADMIN_TOKEN, "spooled class", "en")
            async with await open_student(session, url, room, "Ann", "ann-0001") as ws:
                server.stop()
                for pcm in clips:
                    await say(ws, pcm)
                for _ in range(100):
                    if len(list(spool_dir.glob("*.utt"))) == 2:
                        break
                    await asyncio.sleep(0.1)
        return room

    worker = None
    try:
        _wait(url + "/healthz", 60)
        worker = Proc(tmp_path / "worker.log", "worker", "--redis-url", server.url, "--threads", "2", "--metrics-port", str(mport))
        _wait(f"http://127.0.0.1:{mport}/readyz", 180)
        room = asyncio.run(asyncio.wait_for(speak_while_redis_is_down(), 120))
        assert len(list(spool_dir.glob("*.utt"))) == 2
        gateway.proc.send_signal(signal.SIGKILL)
        gateway.proc.wait(10)
        server.start()
        gateway = Proc(tmp_path / "gateway-again.log", *gateway_args)
        _wait(url + "/healthz", 60)
        client = redis.Redis.from_url(server.url, decode_responses=True)
        for _ in range(600):
            events = [json.loads(f["event"]) for _id, f in client.xrange(history_key(room["room_id"]))]
            transcripts = [e for e in events if e["type"] == "transcript"]
            if len(transcripts) >= 2:
                break
            asyncio.run(asyncio.sleep(0.1))
        client.close()
        assert len(transcripts) == 2 and len({t["utterance_id"] for t in transcripts}) == 2, [e["type"] for e in events]
        assert "dashwood" in transcripts[0]["text"].lower()  # in the order spoken
        assert not list(spool_dir.glob("*.utt"))
    finally:
        if worker is not None:
            worker.stop()
        gateway.stop()
        server.stop()
