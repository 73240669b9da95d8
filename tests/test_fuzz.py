"""Fuzzing every parser a client reaches, against the real `serve` app in this process
(tests/live_app.py, the tiny.en engine): JSON bodies and their types (POST /api/rooms, the
offer), the admin Authorization header, room tokens (random text, mutations of real ones, and
odd claims signed with the real secret), SDP text, the query strings of /ws/ingest and the feed,
WebSocket text and binary messages on /ws/ingest, and Opus packets after {"format": "opus"}.

Every answer is a 4xx or a documented 2xx (201 a room, 200 an answer, 101 a stream that sends
"ready"), every close of a stream the server ends comes after a JSON {"type": "error"} message
and is never 1011, nothing is logged at ERROR, and afterwards the server still answers /healthz
and transcribes real speech over the ingest (paced at real time). Bounded: 30 to 150 examples
per parser (each part of a request fuzzed with the others good, so that every parser is reached),
no example database; about 10 s on 2 cores, most of it the last test's 5 s of speech. A failure
prints the example and how to reproduce it; `--hypothesis-show-statistics` shows the answers each
test got.

Mutated SDP never touches the candidate lines: a candidate on a random address would make the
server send STUN packets to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import string
from fractions import Fraction
from urllib.parse import quote, quote_from_bytes

import aiohttp
import av
import numpy as np
import pytest
import yarl
from aiortc import RTCConfiguration, RTCPeerConnection
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from benchmarks.scoring import wer
from streamserver.loadsim.clients import Dashboard, token_of
from streamserver.rooms import tokens
from streamserver.rooms.registry import LANGUAGES
from streamserver.transport.ws_ingest import FORMATS, MAX_MESSAGE_BYTES
from tests.live_app import ADMIN_TOKEN, SECRET, LiveApp, live_app, ws_outcome

FUZZ = dict(deadline=None, database=None, print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
B64URL = string.ascii_letters + string.digits + "-_"

# --- strategies ---------------------------------------------------------------------------------

TEXT = st.text(max_size=40)  # lone surrogates included: json.dumps writes them as "\ud800" escapes
VALID_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=300)  # what a WebSocket text frame can carry
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT,  # nan and inf too
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
NESTED = st.builds(lambda opener, n, tail: opener * n + tail, st.sampled_from(["[", "{", '{"a":', "[1,", '{"format":']),
                   st.integers(1, 40_000), st.sampled_from(["", "]", "}", "]]]]"]))
RAW_BODIES = st.one_of(st.binary(max_size=300), NESTED.map(str.encode),
                       st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
NAME_TEXT = st.one_of(TEXT, st.text(
    st.sampled_from("Ann\u202e\u202a\u2066\u2069\u200e\u200f\u061c\x00\x07\x1b\x7f\x9f \t"), max_size=90))


def good_or(good, fuzzed):
    """Either the good value or a fuzzed one: with several fields so drawn, most examples get
    past all but one check and reach the parser behind it. (Hypothesis runs no input twice, so
    the good value alone would be tried only once.)"""
    return st.one_of(st.just(good), fuzzed)


@st.composite
def mutated(draw, base, pieces):
    """`base` (str or bytes) after one to four inserts, deletions or overwrites of `pieces`."""
    value = base
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(value)))
        piece = draw(pieces)
        op = draw(st.sampled_from(("insert", "delete", "overwrite")))
        if op == "insert":
            value = value[:at] + piece + value[at:]
        elif op == "delete":
            value = value[:at] + value[at + draw(st.integers(1, 8)):]
        else:
            value = value[:at] + piece + value[at + len(piece):]
    return value


def sign(claim: object) -> str:
    body = tokens._b64(json.dumps(claim).encode())
    return f"{body}.{tokens._b64(hmac.new(SECRET.encode(), body.encode(), hashlib.sha256).digest())}"


def bad_tokens(real: str, room_id: str):
    """Mutations of a real token, random text, and claims of every type signed with the real
    secret (odd `exp`, `room`, `role`): what only a secret holder could make, checked anyway."""
    claims = st.fixed_dictionaries({}, optional={
        "room": st.just(room_id) | JSON, "role": st.sampled_from(tokens.ROLES) | JSON,
        "exp": st.integers(-(2**64), 2**64) | st.floats() | JSON,
    })
    return st.one_of(
        mutated(real, st.text(st.sampled_from(B64URL + "=!.+/ \n\t%é\ud800\udcff\x00"), min_size=1, max_size=3)),
        st.text(max_size=80),
        st.text(st.sampled_from(B64URL + "."), max_size=120),
        claims.map(sign),
        JSON.map(sign),
    )


def sdp_variants(real: str):
    """Random text, and offers rebuilt from the real one's lines, mutated, dropped, repeated,
    reordered; its candidate lines are kept as they are or dropped, never changed."""
    lines = real.strip().split("\r\n")
    keep = [line for line in lines if line.startswith("a=candidate")]
    other = [line for line in lines if not line.startswith("a=candidate")]
    mutable = st.one_of(st.sampled_from(other), st.sampled_from(other).flatmap(lambda line: mutated(line, TEXT)), TEXT)
    candidates = st.lists(st.sampled_from(keep), max_size=len(keep), unique=True) if keep else st.just([])
    rebuilt = st.builds(lambda head, cands, tail: "\r\n".join(head + cands + tail) + "\r\n",
                        st.lists(mutable, max_size=30), candidates, st.lists(mutable, max_size=5))
    return st.one_of(rebuilt, mutated(real, TEXT), st.text(max_size=300))


def query_of(pairs: list[tuple[str | bytes, str | bytes]], junk: str) -> str:
    """A query string written byte for byte: lone surrogates become invalid UTF-8, and the junk
    (stray %, &, =, ;) is appended unescaped."""
    as_bytes = lambda v: v if isinstance(v, bytes) else v.encode("utf-8", "surrogatepass")  # noqa: E731
    return "&".join(f"{quote_from_bytes(as_bytes(k), safe='')}={quote_from_bytes(as_bytes(v), safe='')}"
                    for k, v in pairs) + junk


EXTRA_PAIRS = st.lists(st.tuples(st.sampled_from(["token", "name", "student_id", "room"]) | st.text(max_size=6),
                                st.one_of(TEXT, st.binary(max_size=20), NAME_TEXT)), max_size=3)
QUERY_JUNK = st.text(st.sampled_from("%&=;+?az09"), max_size=12)


# --- fixtures ------------------------------------------------------------------------------------

class _Errors(logging.Handler):
    """Every record at ERROR. (The server turns aiohttp's own record of a request its parser
    refused into one INFO line: streamserver/api/app.py, QuietParserErrors.)"""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


@pytest.fixture(scope="module")
def live(tiny_engine):
    # Seats far above what the fuzzing takes, so that its joins never crowd out the last test; and
    # its students planned as the silent ones they are (they send no audio), so that admission
    # (capacity.py, tested in test_overload.py) never answers "busy" to the inputs fuzzed here.
    with live_app(tiny_engine, max_students=100_000, expected_speaking=0.001) as app:
        errors = _Errors()
        logging.getLogger().addHandler(errors)
        app.errors = errors.records
        try:
            yield app
        finally:
            logging.getLogger().removeHandler(errors)


@pytest.fixture(scope="module")
def room(live: LiveApp) -> dict:
    return live.run(live.create_room("fuzz"))


@pytest.fixture(scope="module")
def real_sdp(live: LiveApp) -> str:
    """An offer as aiortc writes it (host candidates on 127.0.0.1 only: the app set that)."""

    async def offer() -> str:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio", direction="sendonly")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
        await pc.close()
        return sdp

    return live.run(offer())


@pytest.fixture(scope="module")
def opus_packets(librivox) -> list[bytes]:
    audio = librivox[1][1][:16000]  # 1 s of speech
    encoder = av.CodecContext.create("libopus", "w")
    encoder.sample_rate, encoder.layout, encoder.format, encoder.time_base = 48000, "mono", "s16", Fraction(1, 48000)
    resampled = np.interp(np.arange(0, audio.size, 1 / 3), np.arange(audio.size), audio)  # 16 -> 48 kHz
    pcm = (np.clip(resampled, -1, 1) * 32767).astype(np.int16)
    packets = []
    for i in range(0, pcm.size - 960 + 1, 960):
        frame = av.AudioFrame.from_ndarray(pcm[None, i : i + 960], format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48000, i
        packets += [bytes(p) for p in encoder.encode(frame)]
    return packets


def no_errors_logged(live: LiveApp) -> None:
    errors = list(live.errors)
    live.errors.clear()  # one example's errors fail that example only
    assert not errors, "\n".join(errors)


def assert_answered(messages: list[dict], code: int | None) -> None:
    """A stream the server ended: a JSON error first, then a close that is not 1011."""
    assert code is not None, f"the stream neither closed nor answered: {messages}"
    assert code != 1011, messages
    assert messages and messages[-1].get("type") == "error" and isinstance(messages[-1].get("error"), str), (code, messages)


# --- HTTP ---------------------------------------------------------------------------------------

@settings(max_examples=100, **FUZZ)
@given(auth=st.one_of(
    st.just(b"Bearer " + ADMIN_TOKEN.encode()),
    mutated(b"Bearer " + ADMIN_TOKEN.encode(), st.binary(min_size=1, max_size=3)),
    st.binary(max_size=40),
    st.text(max_size=20).map(lambda t: b"Bearer " + t.encode("utf-8", "surrogatepass")),
).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")))
def test_fuzz_admin_authorization(live, auth):
    request = (b"POST /api/rooms HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\nContent-Type: application/json\r\n"
               b"Authorization: " + auth + b'\r\nContent-Length: 13\r\n\r\n{"name": "x"}')
    status, answer = live.run(live.raw_http(request))
    event(f"status {status}")
    assert status in (201, 400, 401), answer[:300]
    if status == 201:  # only the admin token itself, after exactly "Bearer" (any case)
        scheme, _, credential = auth.strip(b" \t").partition(b" ")
        assert scheme.lower() == b"bearer" and credential.strip(b" \t") == ADMIN_TOKEN.encode(), auth
    no_errors_logged(live)


@settings(max_examples=150, **FUZZ)
@given(body=st.one_of(
    st.fixed_dictionaries({"name": good_or("Class", NAME_TEXT | JSON), "language": good_or("en", st.sampled_from(LANGUAGES) | JSON)},
                          optional={"other": JSON}).map(json.dumps).map(str.encode),
    JSON.map(json.dumps).map(str.encode),
    RAW_BODIES,
))
def test_fuzz_create_room_body(live, body):
    async def post() -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with live.session.post(f"{live.url}/api/rooms", data=body, headers=headers) as r:
            return r.status, await r.json()

    status, answer = live.run(post())
    event(f"status {status}")
    assert status in (201, 400, 413), answer
    if status == 201:
        assert set(answer) == {"room_id", "name", "language", "teacher_url", "student_url"}
    else:
        assert isinstance(answer.get("error"), str)
    no_errors_logged(live)


def path_of(room_id: str) -> str:
    return quote(room_id.encode("utf-8", "surrogatepass"), safe="")


async def post_offer(live: LiveApp, room_id: str, body: bytes) -> tuple[int, dict]:
    url = yarl.URL(f"{live.url}/api/rooms/{path_of(room_id)}/offer", encoded=True)
    async with live.session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


def check_offer_answer(status: int, answer: dict) -> None:
    event(f"status {status}: {answer.get('error', '')[:24]}")
    assert status == 200 or 400 <= status < 500, (status, answer)
    if status == 200:
        assert answer["type"] == "answer" and answer["sdp"].startswith("v=0"), answer
    else:
        assert isinstance(answer.get("error"), str), answer


OFFER_PARTS = ("path", "token", "student_name", "sdp type", "types", "body")


@pytest.mark.parametrize("part", OFFER_PARTS)
@settings(max_examples=40, **FUZZ)
@given(data=st.data())
def test_fuzz_offer_fields(live, room, part, data):
    """One part fuzzed, the others good: the room in the path, the token, the name, the sdp and
    type fields as any JSON, every field as any JSON, or the whole body."""
    real = token_of(room["student_url"])
    good = {"token": real, "sdp": "v=0\r\n", "type": "offer", "student_name": "Ann", "student_id": "fuzz-student-01"}
    room_id, body = room["room_id"], good
    if part == "path":
        room_id = data.draw(TEXT, "room id in the path")
    elif part == "token":
        body = {**good, "token": data.draw(bad_tokens(real, room["room_id"]) | JSON, "token")}
    elif part == "student_name":
        body = {**good, "student_name": data.draw(NAME_TEXT | JSON, "name")}
    elif part == "sdp type":
        body = {**good, **data.draw(st.fixed_dictionaries({}, optional={"sdp": JSON, "type": JSON}), "sdp, type")}
    elif part == "types":
        body = data.draw(st.fixed_dictionaries({}, optional={k: JSON for k in good}), "fields")
    raw = data.draw(JSON.map(json.dumps).map(str.encode) | RAW_BODIES, "body") if part == "body" else json.dumps(body).encode()
    check_offer_answer(*live.run(post_offer(live, room_id, raw)))
    no_errors_logged(live)


@settings(max_examples=60, **FUZZ)
@given(data=st.data())
def test_fuzz_offer_sdp(live, room, real_sdp, data):
    """A good token and name, so that every SDP reaches aiortc's parser."""
    sdp = data.draw(good_or(real_sdp, sdp_variants(real_sdp)), "sdp")
    body = {"token": token_of(room["student_url"]), "sdp": sdp, "type": "offer", "student_name": "Ann"}
    check_offer_answer(*live.run(post_offer(live, room["room_id"], json.dumps(body).encode())))
    no_errors_logged(live)


# --- WebSocket handshakes -----------------------------------------------------------------------

async def handshake(live: LiveApp, url: yarl.URL) -> tuple[int, dict | None]:
    """101 and the first message, or the refusal's status."""
    try:
        async with live.session.ws_connect(url) as ws:
            first = await ws.receive_json(timeout=10)
            return 101, first
    except aiohttp.WSServerHandshakeError as error:
        return error.status, None


def fuzzed_query(data, part: str, real: str, room_id: str, name: bool) -> str:
    """The token fuzzed (a name good), or the token good and the rest fuzzed: the name, other
    pairs (repeated keys included), unescaped junk."""
    if part == "token":
        token = data.draw(bad_tokens(real, room_id) | st.binary(max_size=40), "token")
        return query_of([("token", token), *([("name", "Ann")] if name else [])], "")
    pairs = [("token", real)]
    if name:
        pairs += data.draw(st.lists(st.tuples(st.just("name"), NAME_TEXT), max_size=2), "names")
    return query_of(pairs + data.draw(EXTRA_PAIRS, "pairs"), data.draw(QUERY_JUNK, "junk"))


@pytest.mark.parametrize("part", ["token", "rest"])
@settings(max_examples=50, **FUZZ)
@given(data=st.data())
def test_fuzz_ingest_query(live, room, part, data):
    query = fuzzed_query(data, part, token_of(room["student_url"]), room["room_id"], name=True)
    status, first = live.run(handshake(live, yarl.URL(f"{live.ws_url}/ws/ingest?{query}", encoded=True)))
    event(f"status {status}")
    assert status == 101 or 400 <= status < 500, status
    if status == 101:
        assert first["type"] == "ready" and first["room_id"] == room["room_id"], first
    no_errors_logged(live)


@pytest.mark.parametrize("part", ["token", "rest", "path"])
@settings(max_examples=30, **FUZZ)
@given(data=st.data())
def test_fuzz_feed_query(live, room, part, data):
    room_id = data.draw(TEXT, "room id in the path") if part == "path" else room["room_id"]
    query = fuzzed_query(data, "rest" if part == "path" else part, token_of(room["teacher_url"]), room["room_id"], name=False)
    url = yarl.URL(f"{live.ws_url}/api/rooms/{path_of(room_id)}/feed?{query}", encoded=True)
    status, first = live.run(handshake(live, url))
    event(f"status {status}")
    assert status == 101 or 400 <= status < 500, status
    if status == 101:
        assert first["type"] == "history", first
    no_errors_logged(live)


# --- WebSocket messages -------------------------------------------------------------------------

FORMAT_TEXT = st.one_of(
    st.sampled_from([json.dumps({"format": f}) for f in FORMATS]),
    st.fixed_dictionaries({"format": st.sampled_from(FORMATS) | JSON}).map(json.dumps),
    JSON.map(json.dumps),
    VALID_TEXT,
    # up to 200,000 characters: under aiohttp's 1 MiB message limit (past it aiohttp closes with
    # 1009 itself, before our code sees the message)
    st.builds(lambda opener, n: opener * n, st.sampled_from(["[", "{", '{"format":']), st.integers(1, 20_000)),
)
BINARY = st.one_of(st.binary(max_size=1500), st.integers(MAX_MESSAGE_BYTES - 2, MAX_MESSAGE_BYTES + 2).map(bytes))
# After the fuzzed messages: always wrong (no text comes after the first message, and "{}" is no
# format), so the server answers every example with a close: no waiting on a timeout.
PROBE = "{}"


async def stream(live: LiveApp, room: dict, name: str, messages: list[str | bytes]) -> tuple[list[dict], int | None]:
    params = {"token": token_of(room["student_url"]), "name": name}
    async with live.session.ws_connect(f"{live.ws_url}/ws/ingest", params=params) as ws:
        ready = await ws.receive_json(timeout=10)
        assert ready["type"] == "ready", ready
        try:
            for message in [*messages, PROBE]:
                await (ws.send_str(message) if isinstance(message, str) else ws.send_bytes(message))
        except (ConnectionError, aiohttp.ClientError):  # the server closed already: its answer is read below
            pass
        return await ws_outcome(ws)


@settings(max_examples=100, **FUZZ)
@given(messages=st.lists(st.one_of(FORMAT_TEXT, BINARY), min_size=1, max_size=5))
def test_fuzz_ingest_messages(live, room, messages):
    answered, code = live.run(stream(live, room, "Fuzz text", messages))
    event(f"close {code}: {answered[-1].get('error', '')[:30] if answered else ''}")
    assert_answered(answered, code)
    no_errors_logged(live)


@settings(max_examples=80, **FUZZ)
@given(data=st.data())
def test_fuzz_opus_packets(live, room, opus_packets, data):
    real = st.sampled_from(opus_packets)
    packets = data.draw(st.lists(st.one_of(
        real, real.flatmap(lambda p: mutated(p, st.binary(min_size=1, max_size=4))), st.binary(max_size=400),
    ), min_size=1, max_size=10), "packets")
    answered, code = live.run(stream(live, room, "Fuzz opus", [json.dumps({"format": "opus"}), *packets]))
    event(f"close {code}: {answered[-1].get('error', '')[:30] if answered else ''}")
    assert answered[0] == {"type": "format", "format": "opus", "sample_rate": 48000}, answered
    assert_answered(answered, code)
    no_errors_logged(live)


# --- and the server still serves (last: the file's tests run in order) ---------------------------

def test_the_server_still_serves_and_transcribes_after_the_fuzzing(live, librivox):
    _, audio, reference = librivox[4]  # 3.3 s
    pad = lambda s: np.zeros(int(s * 16000), np.float32)  # noqa: E731
    pcm = (np.clip(np.concatenate([pad(0.3), audio, pad(1.0)]), -1, 1) * 32767).astype("<i2").tobytes()

    async def scenario() -> list[dict]:
        async with live.session.get(f"{live.url}/healthz") as r:
            assert r.status == 200 and (await r.json())["ok"]
        room = await live.create_room("after the fuzzing")
        dashboard = await Dashboard().open(live.session, live.url, room)
        params = {"token": token_of(room["student_url"]), "name": "Still here"}
        async with live.session.ws_connect(f"{live.ws_url}/ws/ingest", params=params) as ws:
            assert (await ws.receive_json(timeout=10))["type"] == "ready"
            loop, start, frame = asyncio.get_running_loop(), asyncio.get_running_loop().time(), 640
            for i in range(0, len(pcm), frame):  # at real time: 20 ms every 20 ms
                await ws.send_bytes(pcm[i : i + frame])
                await asyncio.sleep(max(0.0, start + (i + frame) / 32000 - loop.time()))
            deadline = loop.time() + 60
            while not dashboard.transcripts() and loop.time() < deadline:
                await asyncio.sleep(0.1)
        await dashboard.close()
        return dashboard.transcripts()

    transcripts = live.run(scenario(), timeout=120)
    assert transcripts, "no transcript after the fuzzing"
    text = " ".join(t["text"] for t in transcripts)
    assert wer([reference], [text]) <= 0.2, text
    no_errors_logged(live)
