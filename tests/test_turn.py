"""The compose file's TURN service, run: Debian's coturn (`make test` installs it) started with
the very command line of docker/compose.yaml's `turn` service (`--use-auth-secret`), relays a
client's datagrams both ways with a credential the gateway minted (streamserver/turn.py), and
refuses one whose expiry has passed or that another secret made, as the students' browsers would
use it where UDP to the box is blocked (aioice's TURN client: the one aiortc uses).

And the whole way: `/api/config` hands out no ICE server without a room token; with a student's,
it mints a TURN credential, and an aiortc student restricted to relay candidates (a page forced
to relay-only ICE) connects through coturn and is transcribed by the real tiny.en model, while a
peer given an expired credential gets no relay candidate at all."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestServer
from aioice import stun
from aioice.turn import create_turn_endpoint
from aiortc import RTCConfiguration, RTCIceServer, RTCIceTransportPolicy, RTCPeerConnection, RTCSessionDescription
from aiortc.contrib.media import MediaPlayer

from benchmarks.scoring import wer
from streamserver import turn as turn_credentials
from streamserver.config import Settings
from streamserver.loadsim.clients import Dashboard, create_room, speech_file, token_of
from streamserver.server import serve_app
from tests.redis_server import free_port
from tests.server_process import ADMIN_TOKEN, ServerProcess
from tests.system_packages import needs_system
from tests.test_browser import NEEDS_CHROMIUM, _launch  # Debian's Chromium with a fake microphone

COMPOSE = Path(__file__).resolve().parents[1] / "docker" / "compose.yaml"
SECRET, REALM = "turn-test-secret", "classroom"
ADMIN = "turn-test-admin"
# Only for this test, on one machine: coturn refuses to relay to loopback peers by default
# (right for a box on a LAN), and it should listen and relay on loopback only.
TEST_ONLY = ["--allow-loopback-peers", "--listening-ip=127.0.0.1", "--relay-ip=127.0.0.1", "--no-tls", "--no-dtls",
             "--log-file=stdout", "--simple-log"]

pytestmark = needs_system("coturn", None if shutil.which("turnserver") else "its turnserver is not on PATH (make test installs it)")


def compose_turn_command(port: int) -> list[str]:
    """The `turn` service's command from docker/compose.yaml, its ${VAR:-default}s filled in."""
    values = {"TURN_PORT": str(port), "TURN_SECRET": SECRET, "TURN_REALM": REALM}
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
    """coturn on a free port of 127.0.0.1: its port; its log is tmp_path/turn.log."""
    port = free_port()
    command = ["turnserver", *compose_turn_command(port), *TEST_ONLY, f"--pidfile={tmp_path / 'turn.pid'}"]
    assert "--use-auth-secret" in command and f"--static-auth-secret={SECRET}" in command  # the compose file's auth
    log = (tmp_path / "turn.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):  # until it answers on its port
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                raise AssertionError(f"turnserver exited: {(tmp_path / 'turn.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_compose_turn_service_relays_with_a_minted_credential(turn):
    minted = turn_credentials.mint(SECRET, [f"turn:127.0.0.1:{turn}"], Settings.turn_ttl_s, "s1")

    async def relay() -> tuple[bytes, bytes, tuple, tuple]:
        loop = asyncio.get_running_loop()
        peer_transport, peer = await loop.create_datagram_endpoint(Inbox, local_addr=("127.0.0.1", 0))
        peer_addr = peer_transport.get_extra_info("sockname")
        transport, client = await create_turn_endpoint(Inbox, ("127.0.0.1", turn), minted["username"], minted["credential"])
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


@pytest.mark.parametrize("secret, ttl_s", [(SECRET, -5), ("not-the-secret", 3600)], ids=["expired", "another-secret"])
def test_the_compose_turn_service_refuses_an_expired_or_foreign_credential(turn, secret, ttl_s):
    minted = turn_credentials.mint(secret, [f"turn:127.0.0.1:{turn}"], ttl_s, "s1")
    assert int(minted["username"].split(":")[0]) - time.time() == pytest.approx(ttl_s, abs=2)

    async def allocate() -> None:
        transport, _ = await create_turn_endpoint(Inbox, ("127.0.0.1", turn), minted["username"], minted["credential"])
        transport.close()

    with pytest.raises(stun.TransactionFailed) as failure:
        asyncio.run(asyncio.wait_for(allocate(), 15))
    assert "401" in str(failure.value) or "Unauthorized" in str(failure.value)


async def _serving(engine, turn_port: int):  # noqa: ANN001, ANN202 - an Engine; an async context's parts
    """`serve` in this process, handing out coturn's URL with minted credentials: (server, URL)."""
    settings = Settings(admin_token=ADMIN, ice_hosts=["127.0.0.1"], turn_urls=[f"turn:127.0.0.1:{turn_port}?transport=udp"],
                        turn_secret=SECRET)
    app, _ = serve_app(settings, engine, None)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, str(server.make_url("")).rstrip("/")


async def _config(session: aiohttp.ClientSession, url: str, **request: object) -> tuple[int, dict]:
    async with session.get(f"{url}/api/config", **request) as r:  # type: ignore[arg-type]
        return r.status, await r.json()


def test_api_config_hands_turn_credentials_to_token_holders_only(tiny_engine, turn):
    async def body() -> dict[str, tuple[int, dict]]:
        server, url = await _serving(tiny_engine, turn)
        try:
            async with aiohttp.ClientSession() as s:
                room = await create_room(s, url, ADMIN, "config")
                student, teacher = token_of(room["student_url"]), token_of(room["teacher_url"])
                forged = student[:-4] + ("AAAA" if not student.endswith("AAAA") else "BBBB")
                return {
                    "none": await _config(s, url),
                    "forged": await _config(s, url, headers={"Authorization": f"Bearer {forged}"}),
                    "garbage": await _config(s, url, params={"token": "x.y"}),
                    "student": await _config(s, url, headers={"Authorization": f"Bearer {student}"}),
                    "teacher": await _config(s, url, params={"token": teacher}),
                }
        finally:
            await server.close()

    answers = asyncio.run(body())
    for refused in ("none", "forged", "garbage"):
        status, answer = answers[refused]
        assert status == 401 and "ice_servers" not in answer and "credential" not in str(answer), (refused, answer)
    for holder in ("student", "teacher"):
        status, answer = answers[holder]
        assert status == 200, (holder, answer)
        [server] = answer["ice_servers"]
        expiry, _, who = server["username"].partition(":")
        assert server["urls"] == [f"turn:127.0.0.1:{turn}?transport=udp"] and who
        assert int(expiry) - time.time() == pytest.approx(Settings.turn_ttl_s, abs=5)
        assert server["credential"] == turn_credentials.credential(SECRET, server["username"])
    assert answers["student"][1]["ice_servers"][0]["username"] != answers["teacher"][1]["ice_servers"][0]["username"]


def _relay_only(server: dict) -> RTCPeerConnection:
    """An aiortc peer that may use only candidates relayed by this TURN server: a page whose
    RTCPeerConnection has iceTransportPolicy 'relay'."""
    ice = RTCIceServer(urls=server["urls"], username=server["username"], credential=server["credential"])
    return RTCPeerConnection(RTCConfiguration(iceServers=[ice], iceTransportPolicy=RTCIceTransportPolicy.RELAY))


def _candidate_types(sdp: str) -> list[str]:
    return re.findall(r"^a=candidate:.* typ (\w+)", sdp, re.MULTILINE)


def test_a_relay_only_student_is_transcribed_through_coturn(tiny_engine, librivox, tmp_path, turn):
    _, audio, reference = librivox[0]  # 23 words
    wav = speech_file(tmp_path / "speech.wav", audio)

    async def body() -> tuple[list[str], list[str], str, list[str], list[dict]]:
        server, url = await _serving(tiny_engine, turn)
        try:
            async with aiohttp.ClientSession() as s:
                room = await create_room(s, url, ADMIN, "relayed")
                token = token_of(room["student_url"])
                status, config = await _config(s, url, headers={"Authorization": f"Bearer {token}"})
                assert status == 200, config
                [ice] = config["ice_servers"]

                # The same server's credential with its expiry passed: coturn allocates nothing,
                # so a relay-only peer has no candidate to offer.
                username = f"{int(time.time()) - 5}:{ice['username'].partition(':')[2]}"
                expired = _relay_only({**ice, "username": username, "credential": turn_credentials.credential(SECRET, username)})
                expired.addTransceiver("audio", direction="sendonly")
                await expired.setLocalDescription(await expired.createOffer())
                expired_types = _candidate_types(expired.localDescription.sdp)
                await expired.close()

                dashboard = await Dashboard().open(s, url, room)
                pc = _relay_only(ice)
                player = MediaPlayer(str(wav), loop=False)
                pc.addTrack(player.audio)
                await pc.setLocalDescription(await pc.createOffer())
                offered = _candidate_types(pc.localDescription.sdp)
                offer = {"token": token, "sdp": pc.localDescription.sdp, "type": "offer", "student_name": "Rel"}
                async with s.post(f"{url}/api/rooms/{room['room_id']}/offer", json=offer) as r:
                    assert r.status == 200, await r.text()
                    answer = await r.json()
                await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
                for _ in range(200):
                    if pc.connectionState in ("connected", "failed"):
                        break
                    await asyncio.sleep(0.1)
                state = pc.connectionState
                # the pair ICE chose: from the student's relayed candidate
                ice_transport = pc.getTransceivers()[0].sender.transport.transport
                chosen = [pair.local_candidate.type for pair in ice_transport._connection._nominated.values()]
                while player.audio.readyState == "live":  # the file plays to its end
                    await asyncio.sleep(0.1)
                for _ in range(300):  # until the last utterance's final is in
                    if wer([reference], [" ".join(t["text"] for t in dashboard.transcripts())]) <= 0.2:
                        break
                    await asyncio.sleep(0.1)
                await pc.close()
                await dashboard.close()
                return expired_types, offered, state, chosen, dashboard.transcripts()
        finally:
            await server.close()

    expired_types, offered, state, chosen, transcripts = asyncio.run(asyncio.wait_for(body(), 120))
    assert expired_types == [], expired_types  # the expired credential got no relay allocation
    assert offered and set(offered) == {"relay"}, offered  # only coturn's relayed address was offered
    assert state == "connected" and chosen == ["relay"], (state, chosen)
    assert transcripts and {t["student_name"] for t in transcripts} == {"Rel"}, transcripts
    assert wer([reference], [" ".join(t["text"] for t in transcripts)]) <= 0.2, (reference, transcripts)


# Every RTCPeerConnection the page makes is forced to relay-only ICE, as a browser policy or a
# network without UDP would leave it, and kept where the test can read its stats.
RELAY_ONLY = """
const Native = window.RTCPeerConnection;
window.__pcs = [];
window.RTCPeerConnection = function (config) {
  const pc = new Native({ ...(config || {}), iceTransportPolicy: 'relay' });
  window.__pcs.push({ pc, config });
  return pc;
};
window.RTCPeerConnection.prototype = Native.prototype;
"""
# The local candidate of the pair ICE selected, from the page's last peer connection's stats.
SELECTED = """async () => {
  const { pc } = window.__pcs[window.__pcs.length - 1];
  const stats = [...(await pc.getStats()).values()];
  const transport = stats.find((s) => s.type === 'transport' && s.selectedCandidatePairId);
  const pair = stats.find((s) => s.id === transport.selectedCandidatePairId);
  return stats.find((s) => s.id === pair.localCandidateId).candidateType;
}"""


@NEEDS_CHROMIUM
def test_a_browser_page_forced_to_relay_is_transcribed_through_coturn(librivox, tmp_path, turn, monkeypatch):
    """The student page itself (its /api/config request with its token, its reconnect logic) in
    Debian's Chromium, every candidate but coturn's relayed one forbidden, against `serve` given
    --turn-url and the secret in its environment, as an operator runs it."""
    from playwright.sync_api import sync_playwright

    _, audio, reference = librivox[0]
    mic = speech_file(tmp_path / "speech.wav", audio, lead_s=2.0)
    monkeypatch.setenv("STREAMSERVER_TURN_SECRET", SECRET)
    url = f"turn:127.0.0.1:{turn}?transport=udp"
    with ServerProcess("--ice-host", "127.0.0.1", "--turn-url", url) as server:
        async def make() -> dict:
            async with aiohttp.ClientSession() as s:
                return await create_room(s, server.url, ADMIN_TOKEN, "relayed")

        room = asyncio.run(make())
        with sync_playwright() as p:
            browser = _launch(p, tmp_path, mic)
            student = browser.new_page()
            student.add_init_script(RELAY_ONLY)
            student.goto(room["student_url"] + "&name=Rel")
            student.click("#join")
            student.locator("#status", has_text="connected").wait_for(timeout=30000)
            configs = student.evaluate("() => window.__pcs.map((p) => p.config)")
            selected = student.evaluate(SELECTED)

            def texts() -> list[str]:  # Playwright's loop runs in this thread: a plain request
                query = urllib.parse.urlencode({"format": "json", "token": token_of(room["teacher_url"])})
                try:
                    with urllib.request.urlopen(f"{server.url}/api/rooms/{room['room_id']}/transcript?{query}", timeout=10) as r:
                        return [t["text"] for t in json.load(r)["transcripts"]]
                except urllib.error.HTTPError as error:  # 404: nothing final yet
                    assert error.code == 404, error
                    return []

            deadline, said = time.time() + 60, []
            while time.time() < deadline and wer([reference], [" ".join(said)]) > 0.2:
                time.sleep(1)
                said = texts()
            browser.close()

    [ice] = configs[0]["iceServers"]  # what /api/config gave the page, with its token
    assert ice["urls"] == [url] and ice["credential"] == turn_credentials.credential(SECRET, ice["username"])
    assert selected == "relay", selected
    assert wer([reference], [" ".join(said)]) <= 0.2, said


def test_the_secret_comes_from_the_environment_or_a_file(tmp_path):
    """STREAMSERVER_TURN_SECRET, or the file STREAMSERVER_TURN_SECRET_FILE names (a mounted secret);
    never both, never an empty file."""
    path = tmp_path / "turn-secret"
    path.write_text(SECRET + "\n")
    assert turn_credentials.secret_from_env({"STREAMSERVER_TURN_SECRET": SECRET}) == SECRET
    assert turn_credentials.secret_from_env({"STREAMSERVER_TURN_SECRET_FILE": str(path)}) == SECRET
    assert turn_credentials.secret_from_env({}) is None
    path.write_text("\n")
    for environ in ({"STREAMSERVER_TURN_SECRET_FILE": str(path)}, {"STREAMSERVER_TURN_SECRET_FILE": str(tmp_path / "none")},
                    {"STREAMSERVER_TURN_SECRET": SECRET, "STREAMSERVER_TURN_SECRET_FILE": str(path)}):
        with pytest.raises(turn_credentials.TurnSecretError):
            turn_credentials.secret_from_env(environ)
