"""The compose file's TURN service (issue 14), run: Debian's coturn (`make test` installs it)
started with the very command line of docker/compose.yaml's `turn` service, relays a client's
datagrams both ways with the configured user and password, and refuses a wrong password, as
the students' browsers would use it where UDP to the box is blocked (aioice's TURN client: the
one aiortc uses)."""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml
from aioice import stun
from aioice.turn import create_turn_endpoint

from tests.redis_server import free_port
from tests.system_packages import needs_system

COMPOSE = Path(__file__).resolve().parents[1] / "docker" / "compose.yaml"
USER, PASSWORD, REALM = "classroom", "turn-test-secret", "classroom"
# Only for this test, on one machine: coturn refuses to relay to loopback peers by default
# (right for a box on a LAN), and it should listen and relay on loopback only.
TEST_ONLY = ["--allow-loopback-peers", "--listening-ip=127.0.0.1", "--relay-ip=127.0.0.1", "--no-tls", "--no-dtls",
             "--log-file=stdout", "--simple-log"]

pytestmark = needs_system("coturn", None if shutil.which("turnserver") else "its turnserver is not on PATH (make test installs it)")


def compose_turn_command(port: int) -> list[str]:
    """The `turn` service's command from docker/compose.yaml, its ${VAR:-default}s filled in."""
    values = {"TURN_PORT": str(port), "TURN_USER": USER, "TURN_PASSWORD": PASSWORD, "TURN_REALM": REALM}
    command = yaml.safe_load(COMPOSE.read_text())["services"]["turn"]["command"]
    fill = lambda arg: re.sub(r"\$\{(\w+):-[^}]*\}", lambda m: values[m.group(1)], arg)  # noqa: E731
    return [fill(str(arg)) for arg in command]


class Inbox(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.got: asyncio.Queue[tuple[bytes, tuple]] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr) -> None:  # noqa: ANN001
        self.got.put_nowait((data, addr))


@pytest.fixture()
def turn(tmp_path):
    port = free_port()
    command = ["turnserver", *compose_turn_command(port), *TEST_ONLY, f"--pidfile={tmp_path / 'turn.pid'}"]
    assert f"--user={USER}:{PASSWORD}" in command and "--lt-cred-mech" in command  # the compose file's auth
    log = (tmp_path / "turn.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):  # until it answers on its port
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                raise AssertionError(f"turnserver exited: {(tmp_path / 'turn.log').read_text()[-2000:]}")
            subprocess.run(["sleep", "0.1"])
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_compose_turn_service_relays_with_its_credentials(turn):
    async def relay() -> tuple[bytes, bytes, tuple, tuple]:
        loop = asyncio.get_running_loop()
        peer_transport, peer = await loop.create_datagram_endpoint(Inbox, local_addr=("127.0.0.1", 0))
        peer_addr = peer_transport.get_extra_info("sockname")
        transport, client = await create_turn_endpoint(Inbox, ("127.0.0.1", turn), USER, PASSWORD)
        relayed = transport.get_extra_info("sockname")
        try:
            transport.sendto(b"student audio", peer_addr)  # client -> TURN -> the gateway's side
            there, source = await asyncio.wait_for(peer.got.get(), 10)
            peer_transport.sendto(b"gateway reply", source)  # and back, to the relayed address
            back, _ = await asyncio.wait_for(client.got.get(), 10)
        finally:
            transport.close()
            peer_transport.close()
        return there, back, source, relayed

    there, back, source, relayed = asyncio.run(relay())
    assert there == b"student audio" and back == b"gateway reply"
    assert tuple(source) == tuple(relayed)  # the peer saw the relayed address, not the client's


def test_the_compose_turn_service_refuses_a_wrong_password(turn):
    async def allocate() -> None:
        transport, _ = await create_turn_endpoint(Inbox, ("127.0.0.1", turn), USER, "not-the-password")
        transport.close()

    with pytest.raises(stun.TransactionFailed) as failure:
        asyncio.run(asyncio.wait_for(allocate(), 15))
    assert "401" in str(failure.value) or "Unauthorized" in str(failure.value)
