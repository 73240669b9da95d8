"""The server's cost per WebRTC student: N WebRTC students against one `streamserver gateway`.

    flock /tmp/cpu-bench.lock .venv/bin/python -m benchmarks.webrtc_cost --students 20 50 100 \\
        --window 30 --label after --out benchmarks/results/webrtc-cost.json

Starts a redis-server, one `streamserver worker` (tiny.en, so that recognition runs in a process
of its own and is not counted) and, for each N, a fresh `streamserver gateway --ice-host
127.0.0.1`. N students join one room over WebRTC (real aiortc peers: ICE, DTLS, SRTP), each
speaking the shipped clips (streamserver/loadsim/clips) with silences between them as loadsim
plans them, so that a share --speak-ratio of them speaks at any moment, until one common end.
By default their microphones are loadsim's pre-encoded Opus (OpusPlanTrack: the simulator's cost
is small), each on a clock of its own, so that packets arrive spread over each 20 ms as they do
from browsers (`--client packets`: on one clock, every student's packet at once, as loadsim sends
them; `--client aiortc`: aiortc's MediaPlayer, which encodes for every student and falls behind
real time past ~30 students on 2 cores). The pre-encoded students use DTX as the server's answer
asks (a silent student sends ~5 packets a second: transport/dtx.py); `--no-dtx`: every packet,
as from a noisy room where the encoder never goes quiet. Once every student is connected and a few seconds have passed, the
gateway's CPU (utime + stime of /proc/<pid>/stat, all its threads) and this process's (the
simulated students) are read over a --window of seconds; the cost per student-second divides by
the seconds students were streaming within it. RSS per student is the gateway's VmRSS at the end
of the window minus its RSS before the first student, over N. After the streams have ended,
every clip the students spoke (sent whole) is compared with the utterances the gateway announced
(`utterance_queued` on the room's feed) and the transcripts, so that lost speech shows.

Each N's figures are appended to --out (a JSON list of runs, newest last).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiortc.contrib.media import MediaPlayer

from benchmarks.scaleout import _wait_http
from streamserver.loadsim.clients import Dashboard, JoinRefused, create_room, join_student, speech_file
from streamserver.loadsim.scenario import Turn, load_clips, plan_turns, render
from streamserver.loadsim.webrtc_student import PACKET_S, OpusPlanTrack, PacketClock, TimedTrack, encoded_clips
from streamserver.loadsim.ws_student import PlayHooks
from streamserver.transport.udp import DrainingEventLoop
from tests.redis_server import RedisServer, free_port

EXE = [sys.executable, "-m", "streamserver"]
UVLOOP_MAIN = "import sys, uvloop; uvloop.install(); from streamserver.cli import main; sys.exit(main())"
TICK = os.sysconf("SC_CLK_TCK")
LEAD_S, TAIL_S = 1.0, 1.5  # silence around each student's stream (speech_file)
IDLE_S = 10.0  # the gateway with no student, before the first joins
SETTLE_S = 3.0  # after the last join, before the window opens
JOIN_CONCURRENCY = 8
CLIENTS = {
    "packets": "loadsim OpusPlanTrack (pre-encoded Opus), one PacketClock for all: every student's packet on one 20 ms tick",
    "packets-spread": "loadsim OpusPlanTrack (pre-encoded Opus), a PacketClock each: packets spread over the 20 ms as browsers send",
    "aiortc": "aiortc MediaPlayer (encodes for every student)",
}
JOIN_BUDGET_S = 0.15  # per student, before the window opens


def cpu_times(pid: int | str = "self") -> tuple[float, float]:
    """User and system CPU seconds of a process, all its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK  # utime, stime (fields 14, 15)


def cpu_s(pid: int | str = "self") -> float:
    return sum(cpu_times(pid))


def rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


@dataclass
class Student:
    index: int
    track: OpusPlanTrack | TimedTrack
    pc: object = None
    student_id: str = ""
    joined_at: float = 0.0  # monotonic

    @property
    def clips(self) -> int:
        """Clips this student spoke, all of each sent (each one utterance: tests/test_vad_hangover.py)."""
        return len(self.track.timetable.turns) - self.track.timetable.unsent


def microphone(client: str, index: int, end: float, speak_ratio: float, seed: int, clock: PacketClock | None,
               audio_dir: Path) -> OpusPlanTrack | TimedTrack:
    """A student's audio until `end` (epoch seconds): its turns drawn as loadsim draws them."""
    rng = random.Random(seed * 1_000_003 + index)
    clips = load_clips(20)
    planner = lambda length: plan_turns(clips, length, speak_ratio, rng)  # noqa: E731
    if client != "aiortc":  # pre-encoded Opus, on one clock for all or a clock each
        return OpusPlanTrack(clock or PacketClock(), planner, end, PlayHooks(), lead_s=LEAD_S, clips=encoded_clips())
    length = end - time.time() - LEAD_S - TAIL_S
    turns = planner(length)
    wav = speech_file(audio_dir / f"s{index:04d}.wav", render(turns, length), LEAD_S, TAIL_S)
    return TimedTrack(MediaPlayer(str(wav), loop=False).audio, [Turn(t.start_s + LEAD_S, t.clip) for t in turns], PlayHooks())


async def audio_steps_sent(students: list[Student]) -> int:
    """20 ms steps of audio the students have streamed so far: a pre-encoded track's own count
    of its steps (its packets go out through FastRtp, which aiortc's stats never see, and under
    DTX one packet stands for many steps), else its sender's stats (aiortc's encoder: no DTX)."""
    total = 0
    for s in students:
        for sender in s.pc.getSenders():
            if isinstance(sender.track, OpusPlanTrack):
                total += sender.track.sent
                continue
            for stat in (await sender.getStats()).values():
                total += getattr(stat, "packetsSent", 0) if stat.type == "outbound-rtp" else 0
    return total


async def simulate(url: str, admin_token: str, n: int, window_s: float, speak_ratio: float, seed: int,
                   gateway_pid: int, worker_pid: int, client: str, recovery_channel: bool = False, dtx: bool = True) -> dict:
    students: list[Student] = []
    join_failures: Counter = Counter()
    audio_dir = Path(tempfile.mkdtemp(prefix="webrtc-cost-"))
    clock = PacketClock() if client == "packets" else None
    if client != "aiortc":
        encoded_clips()  # once, before the first student
    async with aiohttp.ClientSession() as session:
        room = await create_room(session, url, admin_token, f"cost-{n}")
        dashboard = await Dashboard().open(session, url, room)
        rss0 = rss_bytes(gateway_pid)
        i0, c0 = time.monotonic(), cpu_s(gateway_pid)  # the gateway's own cost with nobody connected
        await asyncio.sleep(IDLE_S)
        idle_cores = (cpu_s(gateway_pid) - c0) / (time.monotonic() - i0)
        started = time.monotonic()
        # Every student streams until one end: the joins (with room to spare), settling, the window, the tail.
        end = time.time() + max(5.0, JOIN_BUDGET_S * n) + SETTLE_S + window_s + 4 + TAIL_S
        gate = asyncio.Semaphore(JOIN_CONCURRENCY)

        async def one(i: int) -> None:
            async with gate:
                student = Student(i, microphone(client, i, end, speak_ratio, seed, clock, audio_dir))
                try:
                    student.pc = await join_student(session, url, room, f"s{i:04d}", student.track,
                                                    recovery_channel=recovery_channel, dtx=dtx)
                except JoinRefused as error:
                    join_failures[str(error.status)] += 1
                    return
                except Exception as error:  # noqa: BLE001 - counted, the run goes on
                    join_failures[type(error).__name__] += 1
                    return
                student.student_id = student.track.student_id = student.pc.student_id  # type: ignore[attr-defined]
                student.joined_at = time.monotonic()
                students.append(student)

        await asyncio.gather(*(one(i) for i in range(n)))
        joined_s = time.monotonic() - started
        print(f"  {len(students)}/{n} joined in {joined_s:.1f}s", file=sys.stderr, flush=True)
        await asyncio.sleep(SETTLE_S)
        window_s = min(window_s, end - TAIL_S - 1 - time.time())  # joins slower than budgeted: a shorter window
        p0 = await audio_steps_sent(students)
        t0, g0, s0, w0, k0 = time.monotonic(), cpu_s(gateway_pid), cpu_s(), cpu_s(worker_pid), cpu_times(gateway_pid)[1]
        await asyncio.sleep(window_s)
        t1, g1, s1, w1, k1 = time.monotonic(), cpu_s(gateway_pid), cpu_s(), cpu_s(worker_pid), cpu_times(gateway_pid)[1]
        sent_s = (await audio_steps_sent(students) - p0) * PACKET_S
        rss1 = rss_bytes(gateway_pid)
        streaming_s = sum(t1 - max(t0, s.joined_at) for s in students)
        await asyncio.sleep(max(0.0, end - time.time()) + 2.0)  # every stream to its end
        for s in students:
            await s.pc.close()
        ids = {s.student_id for s in students}
        spoken = sum(s.clips for s in students)
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
    short = sum(max(0, s.clips - per_student[s.student_id]) for s in students)
    window = t1 - t0
    return {
        "students": n,
        "joined": len(students),
        "join_failures": dict(join_failures),
        "join_s": round(joined_s, 1),
        "window_s": round(window, 1),
        "student_seconds": round(streaming_s, 1),
        "gateway_cpu_s": round(g1 - g0, 2),
        "gateway_cpu_ms_per_student_s": round((g1 - g0) * 1000 / streaming_s, 2) if streaming_s else None,
        "audio_s_sent": round(sent_s, 1),  # below student_seconds when the students fall behind real time
        "gateway_cpu_ms_per_audio_s": round((g1 - g0) * 1000 / sent_s, 2) if sent_s else None,
        "gateway_cores": round((g1 - g0) / window, 3),
        "gateway_system_share": round((k1 - k0) / (g1 - g0), 3) if g1 > g0 else None,  # of its CPU, in the kernel
        "gateway_idle_cores": round(idle_cores, 4),
        "gateway_rss_mb_idle": round(rss0 / 2**20, 1),
        "gateway_rss_mb": round(rss1 / 2**20, 1),
        "gateway_rss_kb_per_student": round((rss1 - rss0) / 1024 / max(1, len(students)), 1),
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
    p.add_argument("--client", choices=CLIENTS, default="packets-spread",
                   help="; ".join(f"{k}: {v}" for k, v in CLIENTS.items()) + " (default %(default)s)")
    p.add_argument("--recovery-channel", action="store_true",
                   help="every student opens the student page's recovery data channel and sends its marks (acks come back)")
    p.add_argument("--no-dtx", action="store_true",
                   help="the students send every packet though the server asks for DTX (a noisy room, where the encoder never goes quiet)")
    p.add_argument("--label", default="", help="what is measured (e.g. the commit or the step)")
    p.add_argument("--gateway-args", default="", help="more arguments for the gateway")
    p.add_argument("--uvloop", action="store_true", help="run the gateway on uvloop's event loop (pip install uvloop)")
    p.add_argument("--gateway-main", type=Path, metavar="FILE",
                   help="a script run in place of `python -m streamserver` for the gateway (experiments: another event loop)")
    p.add_argument("--server-tree", type=Path, metavar="DIR",
                   help="run the gateway from this checkout (e.g. `git worktree add DIR <commit>`): before and after, one simulator")
    p.add_argument("--out", type=Path, required=True, help="JSON list the runs are appended to")
    p.add_argument("--logs", type=Path, help="the processes' logs (default: a temporary folder)")
    args = p.parse_args()

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
            exe = [sys.executable, "-c", UVLOOP_MAIN] if args.uvloop else EXE
            gateway_env = env
            if args.gateway_main:  # a script: the package from the tree measured, not the editable install's
                exe = [sys.executable, str(args.gateway_main.resolve())]
                gateway_env = {**env, "PYTHONPATH": str(tree.resolve())}
            gateway = subprocess.Popen(
                exe + ["gateway", "--port", str(port), "--redis-url", redis.url, "--ice-host", "127.0.0.1",
                       *args.gateway_args.split()],
                env=gateway_env, stdout=open(logs / f"gateway-{n}.log", "w"), stderr=subprocess.STDOUT, cwd=args.server_tree,
            )
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_http(url + "/readyz", 60, "gateway", gateway)
                print(f"{n} WebRTC students, window {args.window:.0f}s", file=sys.stderr, flush=True)
                with asyncio.Runner(loop_factory=DrainingEventLoop) as runner:  # the students' UDP read as loadsim reads it
                    result = runner.run(simulate(url, token, n, args.window, args.speak_ratio, args.seed, gateway.pid, worker.pid,
                                                 args.client, args.recovery_channel, not args.no_dtx))
            finally:
                gateway.terminate()
                gateway.wait(10)
            result.update(label=args.label, event_loop="uvloop" if args.uvloop else "asyncio",
                          gateway_main=str(args.gateway_main or "python -m streamserver"), commit=commit + ("+dirty" if dirty else ""), client=CLIENTS[args.client],
                          speak_ratio=args.speak_ratio, cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M"),
                          recovery_channel=args.recovery_channel, dtx=not args.no_dtx)
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
