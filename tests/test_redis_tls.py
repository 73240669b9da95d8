"""The uplink of an on-prem gateway (issue 14): a central Redis over TLS (`rediss://`, its CA
given with --redis-ca) with an ACL user instead of the default one. A real redis-server with TLS
(Debian's, which `make test` installs), a gateway and a worker process, a student speaking over
the WebSocket ingest and the teacher's feed; a wrong password is one clear line and exit 2."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest

from streamserver.loadsim.clients import Dashboard, create_room
from tests.redis_server import TlsRedisServer, tls_redis_available
from tests.server_process import ADMIN_TOKEN, free_port
from tests.system_packages import needs_system
from tests.test_gateway import ENV, Proc, _wait, open_student, pcm_of, say, transcripts

pytestmark = needs_system("redis-server (built with TLS)", tls_redis_available())


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    with TlsRedisServer(tmp_path_factory.mktemp("redis-tls")) as server:
        yield server


def test_gateway_worker_and_feed_over_a_tls_redis_with_an_acl_user(tls_redis, tmp_path, librivox):
    port, mport = free_port(), free_port()
    uplink = ["--redis-url", tls_redis.url, "--redis-ca", tls_redis.ca_file]
    gateway = Proc(tmp_path / "gateway.log", "gateway", "--port", str(port), *uplink)
    worker = Proc(tmp_path / "worker.log", "worker", *uplink, "--threads", "2", "--metrics-port", str(mport))
    url = f"http://127.0.0.1:{port}"

    async def body() -> None:
        async with aiohttp.ClientSession() as session:
            room = await create_room(session, url, ADMIN_TOKEN, "uplink class", "en")
            dashboard = await Dashboard().open(session, url, room)
            async with await open_student(session, url, room, "Ann", "ann-0001") as ws:
                await say(ws, pcm_of(librivox[0][1]))
                [event] = await transcripts(dashboard, 1)
            assert "dashwood" in event["text"].lower()
            await dashboard.close()

    try:
        _wait(url + "/healthz", 60)
        _wait(f"http://127.0.0.1:{mport}/readyz", 180)
        asyncio.run(asyncio.wait_for(body(), 120))
    finally:
        worker.stop()
        gateway.stop()
    for log in (tmp_path / "gateway.log", tmp_path / "worker.log"):
        assert TlsRedisServer.PASSWORD not in log.read_text()  # no secret in any log line


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_a_wrong_password_is_one_clear_error_and_exit_2(tls_redis, command):
    wrong = tls_redis.url.replace(TlsRedisServer.PASSWORD, "not-the-password")
    run = subprocess.run([sys.executable, "-m", "streamserver", command, "--redis-url", wrong, "--redis-ca", tls_redis.ca_file],
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "credentials" in errors[0], run.stderr
    assert "not-the-password" not in run.stderr
