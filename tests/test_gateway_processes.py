"""`streamserver gateway --processes 2`: one command, two gateways on one port and one bus. New
connections are dealt over both children; a room whose students sit on both is one class (its
transcripts reach its teacher whichever child took the speaker); a child that dies is started
again while the other serves; a stop signal ends them all."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

from benchmarks.scoring import wer
from streamserver.loadsim.scenario import CLIPS_DIR
from tests.redis_server import free_ports_in_a_row
from tests.server_process import free_port
from tests.test_gateway import ADMIN_TOKEN, Proc, _get, _wait, open_student, pcm_of, say

def children_of(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def two_children(pid: int, without: int | None = None) -> set[int] | None:
    children = children_of(pid)
    return children if len(children) == 2 and without not in children else None


def until(what, timeout_s: float):  # noqa: ANN001, ANN201 - any condition
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s")


async def a_class(url: str, students: int, clip: Path) -> tuple[list[dict], str]:
    """Students join one room through the shared port; the first says the clip; the teacher's
    feed (through the same port) gets its transcript."""
    import aiohttp

    from engines.audio import load_audio
    from streamserver.loadsim.clients import Dashboard, create_room

    async with aiohttp.ClientSession() as session:
        room = await create_room(session, url, ADMIN_TOKEN, "lecture")
        dashboard = await Dashboard().open(session, url, room)
        sockets = [await open_student(session, url, room, f"s{i}", f"s{i}") for i in range(students)]
        await say(sockets[0], pcm_of(load_audio(clip)))
        for _ in range(600):
            found = [e for e in dashboard.events if e.get("type") == "transcript"]  # one student speaks
            if found:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # a second transcript of the one clip would come about now
        found = [e for e in dashboard.events if e.get("type") == "transcript"]
        for ws in sockets:
            await ws.close()
        await dashboard.close()
    return found, room["room_id"]


def test_two_gateway_processes_share_a_port_and_a_class(redis_url, tmp_path):
    port, metrics_port, worker_port = free_port(), free_ports_in_a_row(2), free_port()
    url = f"http://127.0.0.1:{port}"
    worker = Proc(tmp_path / "worker.log", "worker", "--redis-url", redis_url, "--threads", "1",
                  "--metrics-port", str(worker_port))
    gateway = Proc(tmp_path / "gateway.log", "--log-format", "json", "gateway", "--processes", "2", "--port", str(port),
                   "--redis-url", redis_url, "--metrics-port", str(metrics_port))
    try:
        _wait(f"http://127.0.0.1:{worker_port}/livez", 180)
        _wait(url + "/livez", 60)
        first = until(lambda: two_children(gateway.proc.pid), 30)
        for i in range(2):  # each child has its own metrics port: the given one plus its place
            _wait(f"http://127.0.0.1:{metrics_port + i}/metrics", 30)
        until(lambda: _get(url + "/readyz")[0] == 200, 120)

        clip = CLIPS_DIR / "flite_1.wav"
        found, room_id = asyncio.run(a_class(url, 12, clip))
        assert len(found) == 1, found
        assert wer([clip.with_suffix(".txt").read_text()], [found[0]["text"]]) <= 0.25

        # The kernel dealt the joins over both children (12 connections: all on one has odds 2^-11).
        joins = [json.loads(line) for line in (tmp_path / "gateway.log").read_text().splitlines()
                 if line.startswith("{") and room_id in line and '"student_id"' in line]
        assert len({j["gateway"] for j in joins if "gateway" in j}) == 2, joins[:4]

        # A child that dies is started again; the other serves meanwhile.
        victim = sorted(first)[0]
        os.kill(victim, signal.SIGKILL)
        until(lambda: not Path(f"/proc/{victim}").exists() or Path(f"/proc/{victim}/stat").read_text().split()[2] == "Z", 10)
        time.sleep(0.5)  # a connection the kernel had queued for the dead child is reset with it
        assert all(_get(url + "/livez")[0] == 200 for _ in range(10))
        again = until(lambda: two_children(gateway.proc.pid, without=victim), 60)
        assert first - {victim} <= again

        gateway.proc.send_signal(signal.SIGTERM)
        assert gateway.proc.wait(40) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in again)
    finally:
        gateway.stop()
        worker.stop()


def test_the_gateways_of_a_killed_command_stop(redis_url, tmp_path):
    """A command SIGKILLed (it cannot hand its stop on) leaves no gateway serving its port."""
    port = free_port()
    gateway = Proc(tmp_path / "gateway.log", "gateway", "--processes", "2", "--port", str(port), "--redis-url", redis_url)
    try:
        _wait(f"http://127.0.0.1:{port}/livez", 60)
        children = until(lambda: two_children(gateway.proc.pid), 30)
        gateway.proc.kill()
        gateway.proc.wait(10)
        until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 20)
    finally:
        gateway.stop()
