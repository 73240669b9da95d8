"""The server's cost per WebRTC student: N WebRTC students against one `streamserver gateway`.

    flock /tmp/cpu-bench.lock .venv/bin/python -m benchmarks.webrtc_cost --students 20 50 100 \\
        --window 30 --label after --out benchmarks/results/webrtc-cost.json

Starts a redis-server, one `streamserver worker` (tiny.en, so that recognition runs in a process
of its own and is not counted) and, for each N, a fresh `streamserver gateway --ice-host
127.0.0.1`. N students join one room over WebRTC, each playing the shipped speech clips
(streamserver/loadsim/clips) with silences between them, so that a share --speak-ratio of them
speaks at any moment. Once every student is connected and a few seconds have passed, the
gateway's CPU (utime + stime of /proc/<pid>/stat, all its threads) and this process's (the
simulated students) are read over a --window of seconds; the cost per student-second divides by
the seconds students were streaming within it. RSS per student is the gateway's VmRSS at the end
of the window minus its RSS before the first student, over N. After the students' files have
played to their end, every clip they spoke is compared with the utterances the gateway announced
(`utterance_queued` on the room's feed) and the transcripts, so that lost speech shows.

Each N's figures are appended to --out (a JSON list of runs, newest last).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import fractions
import functools
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from benchmarks.scaleout import _wait_http
from streamserver.loadsim import clients
from streamserver.loadsim.clients import Dashboard, JoinRefused, create_room, join_student, speech_file
from streamserver.loadsim.scenario import RATE, Clip, Turn, load_clips, plan_turns, render
from tests.redis_server import RedisServer, free_port

EXE = [sys.executable, "-m", "streamserver"]
TICK = os.sysconf("SC_CLK_TCK")
LEAD_S, TAIL_S = 1.0, 1.5  # silence around each student's stream (speech_file)
SETTLE_S = 3.0  # after the last join, before the window opens
JOIN_CONCURRENCY = 8
CLIENTS = {"packets": "join_student, pre-encoded Opus packets (PacketPlayer)", "aiortc": "join_student, aiortc MediaPlayer (encodes)"}
PACKET_S = 0.020  # of audio per RTP packet (aiortc's and browsers' Opus)
OPUS_TIME_BASE = fractions.Fraction(1, 48000)  # RTP's Opus clock


def cpu_s(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process, all its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15)


def rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def opus_packets(pcm: np.ndarray) -> list[bytes]:
    """16 kHz mono int16 as 20 ms Opus packets (one encoder, as a browser's microphone would)."""
    encoder = av.CodecContext.create("libopus", "w")
    encoder.sample_rate, encoder.layout, encoder.format = RATE, "mono", "s16"
    encoder.bit_rate, encoder.options = 32000, {"application": "voip"}
    encoder.time_base = fractions.Fraction(1, RATE)
    frame_n = RATE * 20 // 1000
    pcm = np.concatenate([pcm, np.zeros(-pcm.size % frame_n, np.int16)])
    out: list[bytes] = []
    for i in range(0, pcm.size, frame_n):
        frame = av.AudioFrame.from_ndarray(pcm[None, i : i + frame_n], format="s16", layout="mono")
        frame.sample_rate, frame.pts = RATE, i
        out += [bytes(p) for p in encoder.encode(frame)]
    return out + [bytes(p) for p in encoder.encode(None)]


@functools.cache
def encoded(clip: Clip) -> list[bytes]:
    return opus_packets(np.frombuffer(clip.pcm, "<i2"))


SILENCE = opus_packets(np.zeros(RATE // 50, np.int16))[0]


class PacketTrack(MediaStreamTrack):
    """A microphone of pre-encoded Opus packets, one every 20 ms: aiortc's sender packs them
    into RTP without encoding (`RTCRtpSender` takes an av.Packet as already encoded)."""

    kind = "audio"

    def __init__(self, packets: list[bytes]) -> None:
        super().__init__()
        self.packets, self.sent = packets, 0
        self._start: float | None = None

    async def recv(self) -> av.Packet:
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self.sent * PACKET_S - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        if self.sent >= len(self.packets):
            self.stop()
            raise MediaStreamError
        packet = av.Packet(self.packets[self.sent])
        packet.pts, packet.time_base = self.sent * 960, OPUS_TIME_BASE
        self.sent += 1
        return packet


def schedule(turns: list[Turn], length_s: float) -> list[bytes]:
    """A student's stream as packets: silence, and each turn's clip encoded once per process."""
    slots = [SILENCE] * int(round(length_s / PACKET_S))
    for turn in turns:
        at = int(round(turn.start_s / PACKET_S))
        clip = encoded(turn.clip)[: max(0, len(slots) - at)]
        slots[at : at + len(clip)] = clip
    return slots


class PacketPlayer:
    """Stands in for aiortc's MediaPlayer in join_student: the file name picks the packets."""

    streams: dict[str, list[bytes]] = {}

    def __init__(self, path: str, loop: bool = False) -> None:
        self.audio = PacketTrack(self.streams.pop(path))


@dataclass
class Student:
    index: int
    clips: int  # clips in its file: each one utterance (tests/test_vad_hangover.py)
    length_s: float  # of its whole file
    pc: object = None
    student_id: str = ""
    joined_at: float = 0.0  # monotonic

    @property
    def ends_at(self) -> float:
        return self.joined_at + self.length_s


@dataclass
class Run:
    n: int
    students: list[Student] = field(default_factory=list)
    join_failures: Counter = field(default_factory=Counter)


async def join(session: aiohttp.ClientSession, url: str, room: dict, student: Student, audio_dir: Path,
               speak_ratio: float, seed: int, client: str) -> None:
    rng = random.Random(seed * 100_003 + student.index)
    clips = load_clips(20)
    stream_s = student.length_s - LEAD_S - TAIL_S
    turns = plan_turns(clips, stream_s, speak_ratio, rng)
    student.clips = len(turns)
    wav = audio_dir / f"s{student.index:04d}.wav"
    if client == "packets":
        PacketPlayer.streams[str(wav)] = schedule([Turn(t.start_s + LEAD_S, t.clip) for t in turns], student.length_s)
    else:
        speech_file(wav, render(turns, stream_s), LEAD_S, TAIL_S)
    student.pc = await join_student(session, url, room, f"s{student.index:04d}", wav)
    student.student_id = student.pc.student_id  # type: ignore[attr-defined]
    student.joined_at = time.monotonic()


async def packets_sent(students: list[Student]) -> int:
    """RTP packets the students have sent so far (their senders' stats)."""
    total = 0
    for s in students:
        for sender in s.pc.getSenders():
            for stat in (await sender.getStats()).values():
                total += getattr(stat, "packetsSent", 0) if stat.type == "outbound-rtp" else 0
    return total


async def simulate(url: str, admin_token: str, n: int, window_s: float, speak_ratio: float, seed: int,
                   gateway_pid: int, worker_pid: int, client: str) -> dict:
    run = Run(n)
    audio_dir = Path(tempfile.mkdtemp(prefix="webrtc-cost-"))
    async with aiohttp.ClientSession() as session:
        room = await create_room(session, url, admin_token, f"cost-{n}")
        dashboard = await Dashboard().open(session, url, room)
        rss0 = rss_bytes(gateway_pid)
        started = time.monotonic()
        gate = asyncio.Semaphore(JOIN_CONCURRENCY)
        done = 0

        async def one(i: int) -> None:
            nonlocal done
            async with gate:
                # Each file lasts until the window has closed: the joins still to come at the
                # pace seen so far (with a margin), the settling time, the window and the tail.
                pace = (time.monotonic() - started) / done if done else 0.5
                length = LEAD_S + (n - i) * pace * 1.5 + 2 + SETTLE_S + window_s + 4 + TAIL_S
                student = Student(i, 0, round(length, 2))
                try:
                    await join(session, url, room, student, audio_dir, speak_ratio, seed, client)
                except JoinRefused as error:
                    run.join_failures[str(error.status)] += 1
                    return
                except Exception as error:  # noqa: BLE001 - counted, the run goes on
                    run.join_failures[type(error).__name__] += 1
                    return
                run.students.append(student)
                done += 1

        await asyncio.gather(*(one(i) for i in range(n)))
        joined_s = time.monotonic() - started
        print(f"  {len(run.students)}/{n} joined in {joined_s:.1f}s", file=sys.stderr, flush=True)
        await asyncio.sleep(SETTLE_S)
        p0 = await packets_sent(run.students)
        t0, g0, s0, w0 = time.monotonic(), cpu_s(gateway_pid), cpu_s(), cpu_s(worker_pid)
        await asyncio.sleep(window_s)
        t1, g1, s1, w1 = time.monotonic(), cpu_s(gateway_pid), cpu_s(), cpu_s(worker_pid)
        sent_s = (await packets_sent(run.students) - p0) * PACKET_S
        rss1 = rss_bytes(gateway_pid)
        streaming_s = sum(max(0.0, min(t1, s.ends_at) - max(t0, s.joined_at)) for s in run.students)
        last_end = max((s.ends_at for s in run.students), default=t1)
        await asyncio.sleep(max(0.0, last_end - time.monotonic()) + 1.0)  # every file played to its end
        for s in run.students:
            await s.pc.close()
        ids = {s.student_id for s in run.students}
        spoken = sum(s.clips for s in run.students)
        # the utterances closed by the last silence, then their transcripts
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            queued = [e for e in dashboard.events if e["type"] == "utterance_queued" and e["student_id"] in ids]
            finished = [e for e in dashboard.events if e["type"] in ("transcript", "no_speech", "utterance_failed")
                        and e["student_id"] in ids]
            if len({e["utterance_id"] for e in finished}) >= len(queued) and time.monotonic() > deadline - 25:
                break
            await asyncio.sleep(0.5)
        await dashboard.close()
    kinds = Counter(e["type"] for e in dashboard.events if e.get("student_id") in ids)
    per_student = Counter(e["student_id"] for e in dashboard.events if e["type"] == "utterance_queued")
    short = sum(max(0, s.clips - per_student[s.student_id]) for s in run.students)
    window = t1 - t0
    return {
        "students": n,
        "joined": len(run.students),
        "join_failures": dict(run.join_failures),
        "join_s": round(joined_s, 1),
        "window_s": round(window, 1),
        "student_seconds": round(streaming_s, 1),
        "gateway_cpu_s": round(g1 - g0, 2),
        "gateway_cpu_ms_per_student_s": round((g1 - g0) * 1000 / streaming_s, 2) if streaming_s else None,
        "audio_s_sent": round(sent_s, 1),  # below student_seconds when the students fall behind real time
        "gateway_cpu_ms_per_audio_s": round((g1 - g0) * 1000 / sent_s, 2) if sent_s else None,
        "gateway_cores": round((g1 - g0) / window, 3),
        "gateway_rss_mb_idle": round(rss0 / 2**20, 1),
        "gateway_rss_mb": round(rss1 / 2**20, 1),
        "gateway_rss_kb_per_student": round((rss1 - rss0) / 1024 / max(1, len(run.students)), 1),
        "simulator_cpu_ms_per_student_s": round((s1 - s0) * 1000 / streaming_s, 2) if streaming_s else None,
        "simulator_cores": round((s1 - s0) / window, 3),
        "worker_cpu_s": round(w1 - w0, 2),
        "clips_spoken": spoken,
        "utterances_queued": kinds["utterance_queued"],
        "utterances_dropped": kinds["utterance_dropped"],
        "transcripts": kinds["transcript"],
        "no_speech": kinds["no_speech"],
        "failed": kinds["utterance_failed"],
        "clips_without_utterance": short,
        "extra_utterances": max(0, kinds["utterance_queued"] - spoken + short),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--students", type=int, nargs="+", default=[20, 50, 100])
    p.add_argument("--window", type=float, default=30, help="seconds of measurement, after every student joined")
    p.add_argument("--speak-ratio", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--client", choices=CLIENTS, default="packets",
                   help="packets: pre-encoded Opus, one encoding per clip; aiortc: join_student, an aiortc MediaPlayer "
                        "that encodes every student's audio")
    p.add_argument("--label", default="", help="what is measured (e.g. the commit or the step)")
    p.add_argument("--gateway-args", default="", help="more arguments for the gateway")
    p.add_argument("--server-tree", type=Path, metavar="DIR",
                   help="run the gateway from this checkout (e.g. `git worktree add DIR <commit>`): before and after, one simulator")
    p.add_argument("--out", type=Path, required=True, help="JSON list the runs are appended to")
    p.add_argument("--logs", type=Path, help="the processes' logs (default: a temporary folder)")
    args = p.parse_args()
    if args.client == "packets":
        clients.MediaPlayer = PacketPlayer  # join_student's microphone

    token = os.environ.setdefault("STREAMSERVER_ADMIN_TOKEN", "webrtc-cost-admin")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STREAMSERVER_SECRET": os.environ.get("STREAMSERVER_SECRET") or secrets.token_hex(32)}
    logs = args.logs or Path(tempfile.mkdtemp(prefix="webrtc-cost-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    tree = args.server_tree or Path.cwd()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=tree).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "streamserver"], capture_output=True, text=True,
                                cwd=tree).stdout.strip())
    redis = RedisServer().start()
    procs: list[subprocess.Popen] = []
    results = []
    try:
        mport = free_port()
        worker = subprocess.Popen(
            EXE + ["worker", "--redis-url", redis.url, "--model", "tiny.en", "--threads", "1", "--name", "worker-0",
                   "--metrics-port", str(mport)],
            env=env, stdout=open(logs / "worker.log", "w"), stderr=subprocess.STDOUT,
        )
        procs.append(worker)
        _wait_http(f"http://127.0.0.1:{mport}/readyz", 180, "worker", worker)
        for n in args.students:
            port = free_port()
            gateway = subprocess.Popen(
                EXE + ["gateway", "--port", str(port), "--redis-url", redis.url, "--ice-host", "127.0.0.1",
                       *args.gateway_args.split()],
                env=env, stdout=open(logs / f"gateway-{n}.log", "w"), stderr=subprocess.STDOUT, cwd=args.server_tree,
            )
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_http(url + "/readyz", 60, "gateway", gateway)
                print(f"{n} WebRTC students, window {args.window:.0f}s", file=sys.stderr, flush=True)
                result = asyncio.run(simulate(url, token, n, args.window, args.speak_ratio, args.seed, gateway.pid, worker.pid,
                                              args.client))
            finally:
                gateway.terminate()
                gateway.wait(10)
            result.update(label=args.label, commit=commit + ("+dirty" if dirty else ""), client=CLIENTS[args.client],
                          speak_ratio=args.speak_ratio, cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M"))
            print(json.dumps(result), file=sys.stderr, flush=True)
            results.append(result)
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.stop()
    old = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(old + results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
