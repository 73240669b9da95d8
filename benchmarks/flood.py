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
    parser.add_argument("--admin-token", default=os.environ.get("STREAMSERVER_ADMIN_TOKEN"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args.url, args.admin_token, args.pid, args.flood_s, args.reconnect))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
