"""One hostile student link against a running server: does another room still get its transcripts?

A flooder holding room A's student link sends speech over the WebSocket ingest as fast as the
socket takes it for `--flood-s` seconds: on one connection (the probe of issue 12), or with
`--reconnect` opening a new one (a new student) each time it is refused. Meanwhile an
honest student in room B speaks LibriVox clips in real time and B's dashboard times each
transcript (arrival - end_of_speech_ts, one machine's clock). The server's resident memory is
read from /proc before and during the flood.

    STREAMSERVER_ADMIN_TOKEN=t streamserver serve --port 8097 &
    STREAMSERVER_ADMIN_TOKEN=t .venv/bin/python -m benchmarks.flood --url http://127.0.0.1:8097 \
        --pid $(pgrep -f 'serve --port 8097') --flood-s 15 --out benchmarks/results/flood-15s.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.audio import load_audio  # noqa: E402
from engines.features import SAMPLE_RATE  # noqa: E402
from streamserver.loadsim.clients import Dashboard, create_room, token_of  # noqa: E402

CLIPS = sorted((Path(__file__).resolve().parent.parent / "tests" / "data" / "librivox").glob("*.wav"))
FRAME = 640  # 20 ms of PCM16


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def pcm16(audio: np.ndarray, tail_s: float) -> bytes:
    padded = np.concatenate([audio, np.zeros(int(tail_s * SAMPLE_RATE), np.float32)])
    return (np.clip(padded, -1, 1) * 32767).astype("<i2").tobytes()


def ingest_url(url: str, room: dict, name: str) -> str:
    return url.replace("http", "ws", 1) + f"/ws/ingest?token={token_of(room['student_url'])}&name={name}"


async def flood(session: aiohttp.ClientSession, url: str, room: dict, speech: bytes, seconds: float, reconnect: bool) -> dict:
    """Send `speech` over and over as fast as possible; with `reconnect`, again whenever refused."""
    connections, refusals, sent, reasons = 0, 0, 0, set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (reconnect or connections == 0):
        try:
            async with session.ws_connect(ingest_url(url, room, "Flooder")) as ws:
                connections += 1
                await ws.receive_json(timeout=10)
                while time.monotonic() < deadline and not ws.closed:
                    for i in range(0, len(speech), FRAME):
                        await ws.send_bytes(speech[i : i + FRAME])
                        sent += FRAME
                    await asyncio.sleep(0)
                    if ws.closed or (message := await _pending(ws)) is not None:
                        if message is not None and message.get("type") == "error":
                            reasons.add(message["error"])
                            refusals += "real time" in message["error"]
                        break
                if not ws.closed:
                    await ws.close()
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as error:
            reasons.add(f"{type(error).__name__}: {error}"[:200])
            await asyncio.sleep(0.05)
    return {"connections": connections, "refused_too_fast": refusals, "audio_sent_s": round(sent / 2 / SAMPLE_RATE, 1),
            "reasons": sorted(reasons)}


async def _pending(ws: aiohttp.ClientWebSocketResponse) -> dict | None:
    try:
        message = await ws.receive(timeout=0.001)
    except asyncio.TimeoutError:
        return None
    return json.loads(message.data) if message.type == aiohttp.WSMsgType.TEXT else {}


async def honest_student(session: aiohttp.ClientSession, url: str, room: dict, clips: list[bytes], seconds: float) -> int:
    """Speak clips in real time (20 ms frames on a shared clock) until `seconds` have passed."""
    spoken = 0
    start = time.monotonic()
    async with session.ws_connect(ingest_url(url, room, "Honest")) as ws:
        await ws.receive_json(timeout=10)
        frames_sent = 0
        while time.monotonic() - start < seconds:
            clip = clips[spoken % len(clips)]
            for i in range(0, len(clip), FRAME):
                await ws.send_bytes(clip[i : i + FRAME])
                frames_sent += 1
                await asyncio.sleep(max(0.0, start + frames_sent * 0.02 - time.monotonic()))
            spoken += 1
    return spoken


async def run(url: str, admin_token: str, pid: int, flood_s: float, reconnect: bool = False) -> dict:
    clips = [pcm16(load_audio(p), tail_s=1.2) for p in CLIPS]
    async with aiohttp.ClientSession() as s:
        quiet, loud = await create_room(s, url, admin_token, "room B"), await create_room(s, url, admin_token, "room A")
        dashboard = await Dashboard(on_event=_stamp).open(s, url, quiet)
        await asyncio.sleep(1.0)
        idle = rss_bytes(pid)
        peak = idle

        async def watch_memory() -> None:
            nonlocal peak
            while True:
                peak = max(peak, rss_bytes(pid))
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch_memory())
        flooded, spoken = await asyncio.gather(flood(s, url, loud, clips[0], flood_s, reconnect),
                                                honest_student(s, url, quiet, clips, flood_s + 2.0))
        for _ in range(100):  # the last clip's transcript
            if len(dashboard.transcripts()) >= spoken:
                break
            await asyncio.sleep(0.1)
        watcher.cancel()
        await dashboard.close()
    latencies = [t["_received"] - t["end_of_speech_ts"] for t in _stamped(dashboard)]
    return {
        "flood_s": flood_s, "reconnect": reconnect, "flood": flooded, "honest_clips_spoken": spoken, "honest_transcripts": len(latencies),
        "honest_latency_s": {"max": round(max(latencies), 3) if latencies else None,
                             "all": [round(x, 3) for x in latencies]},
        "rss_idle_mb": round(idle / 2**20, 1), "rss_peak_mb": round(peak / 2**20, 1), "rss_ratio": round(peak / idle, 3),
    }


# --- parallel paced streams of one link (issue 33) ----------------------------------------------------

PACED_MESSAGE = 3200  # 100 ms of PCM16 a message, as the load simulator sends


def _session(address: str) -> aiohttp.ClientSession:
    """A client whose connections come from `address` (any 127.x.y.z is this machine's loopback)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(address, 0), limit=0))


async def paced_stream(session: aiohttp.ClientSession, url: str, token: str, name: str, speech: bytes, seconds: float,
                       rate: float) -> dict:
    """`speech` over and over at `rate` x real time for `seconds`, or until the server ends the
    stream: how it went (refused at the handshake, closed and why, or audio sent to the end)."""
    try:
        async with session.ws_connect(url.replace("http", "ws", 1) + "/ws/ingest", params={"token": token, "name": name}) as ws:
            await ws.receive_json(timeout=30)
            reader = asyncio.create_task(_read_until_closed(ws))  # so that a close from the server is seen
            start, sent = time.monotonic(), 0
            with contextlib.suppress(ConnectionError):  # closed while a message was on its way
                while time.monotonic() - start < seconds and not ws.closed:
                    for i in range(0, len(speech), PACED_MESSAGE):
                        await ws.send_bytes(speech[i : i + PACED_MESSAGE])
                        sent += 1
                        await asyncio.sleep(max(0.0, start + sent * 0.1 / rate - time.monotonic()))
                        if ws.closed or time.monotonic() - start >= seconds:
                            break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), 0 if not ws.closed else 2)
            reader.cancel()
            if not ws.closed:
                await ws.close()
                return {"outcome": "sent to the end", "audio_s": sent / 10}
            return {"outcome": f"closed {ws.close_code}", "audio_s": sent / 10}
    except aiohttp.WSServerHandshakeError as error:
        return {"outcome": f"refused {error.status}", "audio_s": 0.0}
    except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as error:
        return {"outcome": f"closed ({type(error).__name__})", "audio_s": 0.0}


async def _read_until_closed(ws: aiohttp.ClientWebSocketResponse) -> None:
    async for _ in ws:
        pass


async def speak(session: aiohttp.ClientSession, url: str, token: str, name: str, clips: list[bytes], seconds: float,
                identity: dict[str, str] | None = None) -> tuple[dict[str, str], int]:
    """An honest student: clips in real time (100 ms messages on a shared clock) until `seconds`
    have passed. Its identity (student id and resume secret, to come back as itself) and the clips
    it spoke."""
    spoken, sent = 0, 0
    start = time.monotonic()
    params = {"token": token, "name": name, **(identity or {})}
    async with session.ws_connect(url.replace("http", "ws", 1) + "/ws/ingest", params=params) as ws:
        ready = await ws.receive_json(timeout=30)
        identity = {"student_id": ready["student_id"], "resume": ready["resume"]}
        while time.monotonic() - start < seconds:
            clip = clips[spoken % len(clips)]
            for i in range(0, len(clip), PACED_MESSAGE):
                await ws.send_bytes(clip[i : i + PACED_MESSAGE])
                sent += 1
                await asyncio.sleep(max(0.0, start + sent * 0.1 - time.monotonic()))
            spoken += 1
    return identity, spoken


def _latencies(dashboard: Dashboard, student_id: str, after: float, before: float) -> list[float]:
    return [round(t["_received"] - t["end_of_speech_ts"], 3) for t in _stamped(dashboard)
            if t["student_id"] == student_id and after <= t["end_of_speech_ts"] < before]


def _dropped(dashboard: Dashboard, student_id: str, others: bool = False) -> int:
    """The room's dropped utterances of `student_id` (`others`: of every other student)."""
    return sum(1 for e in dashboard.events
               if e["type"] == "utterance_dropped" and (e.get("student_id") == student_id) != others)


async def _all_heard(dashboards: list[tuple[Dashboard, str, int]], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(sum(1 for t in d.transcripts() if t["student_id"] == sid) >= n for d, sid, n in dashboards):
            return
        await asyncio.sleep(0.1)


async def run_parallel(url: str, admin_token: str, pid: int, streams: int = 100, flood_s: float = 30.0, rate: float = 1.4,
                       link: str = "per-student", idle_s: float = 15.0, after_s: float = 10.0) -> dict:
    """`streams` paced streams at `rate` x real time of one link in room A for `flood_s`, from one
    address (127.0.0.1), while a real student speaks in room A (127.0.0.2) and one in room B
    (127.0.0.3). First `idle_s` of the real students alone: room B's latency at idle, and the
    server's memory before the flood; the memory again `after_s` after the flood.
    `link`: "per-student" (room A hands out per-student links; the flooder holds one) or
    "shared" (room A's shared link, every option at its default)."""
    clips = [pcm16(load_audio(p), tail_s=1.2) for p in CLIPS]
    flood_speech = clips[0]
    async with aiohttp.ClientSession() as admin, _session("127.0.0.1") as flooder, _session("127.0.0.2") as school_a, \
            _session("127.0.0.3") as school_b:
        room_b = await create_room(admin, url, admin_token, "room B")
        headers = {"Authorization": f"Bearer {admin_token}"}
        body: dict = {"name": "room A", **({"student_links": 2} if link == "per-student" else {})}
        async with admin.post(f"{url}/api/rooms", json=body, headers=headers) as r:
            room_a = await r.json()
        if link == "per-student":
            flood_token, honest_a = (token_of(x["student_url"]) for x in room_a["student_links"])
        else:
            flood_token = honest_a = token_of(room_a["student_url"])
        honest_b = token_of(room_b["student_url"])
        dash_a = await Dashboard(on_event=_stamp).open(admin, url, room_a)
        dash_b = await Dashboard(on_event=_stamp).open(admin, url, room_b)
        await asyncio.sleep(1.0)

        idle_from = time.time()
        (ann, a_idle), (bob, b_idle) = await asyncio.gather(speak(school_a, url, honest_a, "Ann", clips, idle_s),
                                                            speak(school_b, url, honest_b, "Bob", clips, idle_s))
        a_id, b_id = ann["student_id"], bob["student_id"]
        await _all_heard([(dash_a, a_id, a_idle), (dash_b, b_id, b_idle)], 30)
        rss_before = rss_bytes(pid)
        peak = rss_before

        async def watch_memory() -> None:
            nonlocal peak
            while True:
                peak = max(peak, rss_bytes(pid))
                await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch_memory())
        flood_from = time.time()
        flooded, (_, a_spoken), (_, b_spoken) = await asyncio.gather(
            asyncio.gather(*(paced_stream(flooder, url, flood_token, f"Flood{i}", flood_speech, flood_s, rate)
                             for i in range(streams))),
            speak(school_a, url, honest_a, "Ann", clips, flood_s, ann),
            speak(school_b, url, honest_b, "Bob", clips, flood_s, bob))
        flood_to = time.time()
        await _all_heard([(dash_a, a_id, a_idle + a_spoken), (dash_b, b_id, b_idle + b_spoken)], 120)
        await asyncio.sleep(max(0.0, flood_to + after_s - time.time()))
        rss_after = rss_bytes(pid)
        watcher.cancel()
        await dash_a.close()
        await dash_b.close()
    outcomes: dict[str, int] = {}
    for f in flooded:
        outcomes[f["outcome"]] = outcomes.get(f["outcome"], 0) + 1
    b_at_idle, b_in_flood = _latencies(dash_b, b_id, idle_from, flood_from), _latencies(dash_b, b_id, flood_from, flood_to + 60)

    def mean(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs), 3) if xs else None

    return {
        "link": link, "streams": streams, "rate": rate, "flood_s": flood_s,
        "flood": {"outcomes": outcomes, "audio_sent_s": round(sum(f["audio_s"] for f in flooded), 1)},
        "room_a": {"clips_spoken": a_idle + a_spoken, "transcripts": sum(1 for t in dash_a.transcripts() if t["student_id"] == a_id),
                   "dropped": _dropped(dash_a, a_id), "flood_dropped": _dropped(dash_a, a_id, others=True)},
        "room_b": {"clips_spoken": b_idle + b_spoken, "transcripts": sum(1 for t in dash_b.transcripts() if t["student_id"] == b_id),
                   "dropped": _dropped(dash_b, b_id), "latency_idle_s": b_at_idle, "latency_flood_s": b_in_flood,
                   "mean_idle_s": mean(b_at_idle), "mean_flood_s": mean(b_in_flood),
                   "latency_ratio": round(mean(b_in_flood) / mean(b_at_idle), 3) if b_at_idle and b_in_flood else None},
        "rss_before_mb": round(rss_before / 2**20, 1), "rss_peak_mb": round(peak / 2**20, 1),
        "rss_after_mb": round(rss_after / 2**20, 1), "rss_after_ratio": round(rss_after / rss_before, 3),
        "rss_after_s": after_s,
    }


def _stamp(event: dict, received: float, from_history: bool) -> None:
    if not from_history:
        event["_received"] = received


def _stamped(dashboard: Dashboard) -> list[dict]:
    return [t for t in dashboard.transcripts() if "_received" in t]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--pid", type=int, required=True, help="the server process (its memory is read from /proc)")
    parser.add_argument("--flood-s", type=float, default=2.0)
    parser.add_argument("--reconnect", action="store_true", help="a new connection each time the flooder is refused")
    parser.add_argument("--parallel", type=int, metavar="N",
                        help="N parallel paced streams of one link instead, with a real student in room A and B")
    parser.add_argument("--rate", type=float, default=1.4, help="with --parallel: each stream's pace, x real time")
    parser.add_argument("--link", choices=("per-student", "shared"), default="per-student",
                        help="with --parallel: room A's links (the flooder holds one)")
    parser.add_argument("--admin-token", default=os.environ.get("STREAMSERVER_ADMIN_TOKEN"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.parallel:
        result = asyncio.run(run_parallel(args.url, args.admin_token, args.pid, args.parallel, args.flood_s, args.rate, args.link))
    else:
        result = asyncio.run(run(args.url, args.admin_token, args.pid, args.flood_s, args.reconnect))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
