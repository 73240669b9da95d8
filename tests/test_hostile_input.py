"""What a hostile client sends gets a 4xx or a WebSocket close with a JSON reason, never a 500 or
1011: one regression test per 500 of the issue 12 probe, and the pages' headers, links and
student names. Against the real `serve` app in this process (tests/live_app.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from streamserver.api.app import SECURITY_HEADERS
from streamserver.loadsim.clients import link_param, token_of
from tests.live_app import ADMIN_TOKEN, live_app, ws_outcome

WEB_DEMO = Path(__file__).resolve().parents[1] / "streamserver" / "web_demo"
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
            "media-src 'self' blob:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


@pytest.fixture(scope="module")
def live(tiny_engine):
    with live_app(tiny_engine, max_students=1000) as app:
        yield app


@pytest.fixture(scope="module")
def room(live) -> dict:
    return live.run(live.create_room("hostile"))


def post_rooms(authorization: bytes, body: bytes = b'{"name": "x"}') -> bytes:
    return (b"POST /api/rooms HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Authorization: " + authorization + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def test_non_ascii_authorization_is_401(live):
    """The probe: hmac.compare_digest raised TypeError on a non-ASCII str (500)."""
    for header in ("Bearer é".encode(), "é".encode(), b"Bearer \xff\xfe", b"\xff", "Bearer ".encode() + ADMIN_TOKEN.encode() + "é".encode()):
        status, answer = live.run(live.raw_http(post_rooms(header)))
        assert status == 401, answer
        assert b"admin token required" in answer
    assert live.run(live.raw_http(post_rooms(b"Bearer " + ADMIN_TOKEN.encode())))[0] == 201


def test_bearer_is_required(live):
    """The probe: `Authorization: TOKEN` without `Bearer` was accepted."""
    for header in (ADMIN_TOKEN, f"Basic {ADMIN_TOKEN}", f"Bearer{ADMIN_TOKEN}", f"Bearer {ADMIN_TOKEN}x", "Bearer "):
        assert live.run(live.raw_http(post_rooms(header.encode())))[0] == 401, header


def test_lone_surrogate_in_a_json_token_is_401(live, room):
    """The probe: a token with a JSON "\\ud800" escape reached str.encode (500)."""
    offer = f"{live.url}/api/rooms/{room['room_id']}/offer"
    token = token_of(room["student_url"])

    async def post(raw: str) -> int:
        async with live.session.post(offer, data=raw.encode(), headers={"Content-Type": "application/json"}) as r:
            assert r.content_type == "application/json"
            return r.status

    for bad in ("\\ud800", token[:20] + "\\ud800" + token[20:], token + "\\udfff", "\\udcff.\\udcff"):
        raw = '{"token": "%s", "sdp": "v=0", "type": "offer", "student_name": "Ann"}' % bad
        assert live.run(post(raw)) == 401, bad
    # the same escape in the other strings: a 400, never a 500
    for field in ("sdp", "student_name", "student_id", "type"):
        body = {"token": token, "sdp": "v=0", "type": "offer", "student_name": "Ann", "student_id": "s" * 10}
        raw = json.dumps({**body, field: "\ud800" + body[field] + "\udfff"})  # json.dumps writes the escapes
        assert live.run(post(raw)) == 400, field


@pytest.mark.parametrize("route", ["rooms", "offer"])
def test_deeply_nested_json_body_is_400(live, room, route):
    """The probe: 30,000 `[` raised RecursionError in json.loads (500)."""
    url = f"{live.url}/api/rooms" if route == "rooms" else f"{live.url}/api/rooms/{room['room_id']}/offer"

    async def post(body: bytes) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with live.session.post(url, data=body, headers=headers) as r:
            return r.status, await r.json()

    for body in (b"[" * 30_000, b'{"name": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", b"{" * 30_000):
        status, answer = live.run(post(body))
        assert status == 400 and answer == {"error": "body is not valid JSON"}
    status, answer = live.run(post(b"1" * 5000))  # int() refuses over 4300 digits: also a ValueError
    assert status == 400


def test_unknown_charset_is_400(live):
    async def post() -> int:
        headers = {"Content-Type": "application/json; charset=no-such-codec", "Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with live.session.post(f"{live.url}/api/rooms", data=b'{"name": "x"}', headers=headers) as r:
            return r.status

    assert live.run(post()) == 400


def test_ws_text_of_100000_brackets_is_a_close_with_a_json_reason(live, room):
    """The probe: RecursionError in the format message's json.loads closed the stream with 1011."""

    async def scenario(text: str) -> tuple[list[dict], int | None]:
        params = {"token": token_of(room["student_url"]), "name": "Brackets"}
        async with live.session.ws_connect(f"{live.ws_url}/ws/ingest", params=params) as ws:
            assert (await ws.receive_json(timeout=10))["type"] == "ready"
            await ws.send_str(text)
            return await ws_outcome(ws)

    for text in ("[" * 100_000, '{"format": ' + "[" * 200 + "]" * 200 + "}", "[" * 250, "9" * 250):
        messages, code = live.run(scenario(text))
        assert code in (1003, 1007) and messages[-1]["type"] == "error", (text[:20], code, messages)


def test_security_headers_on_every_response(live, room):
    offer = f"/api/rooms/{room['room_id']}/offer"
    gets = ["/student", "/teacher", "/static/student.js", "/static/teacher.js", "/static/style.css", "/healthz",
            "/readyz", "/api/config", "/metrics", "/nosuchpage", "/static/nosuchfile", "/ws/ingest",
            "/ws/ingest?token=x", f"/api/rooms/{room['room_id']}/feed?token=x", "/api/rooms/nosuchroom/feed"]

    async def scenario() -> list[tuple[str, int, dict]]:
        answers = []
        for path in gets:
            async with live.session.get(live.url + path) as r:
                answers.append((path, r.status, dict(r.headers)))
        for path, body in (("/api/rooms", b"{}"), (offer, b"{"), (offer, b'{"token": "x"}'), ("/api/rooms/x/offer", b"{}")):
            async with live.session.post(live.url + path, data=body) as r:
                answers.append((path, r.status, dict(r.headers)))
        return answers

    answers = live.run(scenario())
    assert {status for _, status, _ in answers} >= {200, 400, 401, 404}
    for path, status, headers in answers:
        assert headers.get("Referrer-Policy") == "no-referrer", (path, status)
        assert headers.get("X-Content-Type-Options") == "nosniff", (path, status)
        assert headers.get("Content-Security-Policy") == PAGE_CSP, (path, status)
    assert SECURITY_HEADERS["Content-Security-Policy"] == PAGE_CSP
    pages = {path: headers for path, status, headers in answers if path in ("/student", "/teacher")}
    assert all(h["Content-Type"].startswith("text/html") for h in pages.values()) and len(pages) == 2


class _Inline(HTMLParser):
    """Whatever a CSP without 'unsafe-inline' would block: inline scripts, <style>, style
    attributes, event-handler attributes, javascript: URLs."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = {name for name, _ in attrs}
        if tag == "script" and "src" not in names:
            self.found.append("inline <script>")
        if tag == "style":
            self.found.append("<style>")
        for name, value in attrs:
            if name == "style" or name.startswith("on"):
                self.found.append(f"<{tag} {name}=>")
            if value and value.strip().lower().startswith("javascript:"):
                self.found.append(f"<{tag} {name}=javascript:>")


@pytest.mark.parametrize("page", ["student.html", "teacher.html"])
def test_pages_have_no_inline_script_style_or_handlers(page):
    parser = _Inline()
    parser.feed((WEB_DEMO / page).read_text())
    assert parser.found == []
    script = (WEB_DEMO / page.replace(".html", ".js")).read_text()
    for forbidden in ("eval(", "new Function", "innerHTML", "setAttribute('style'"):
        assert forbidden not in script, forbidden
    assert "new URLSearchParams(location.hash.slice(1))" in script  # the link's room and token


def test_links_carry_the_token_in_the_fragment_and_the_pages_open(live, room):
    for role in ("student", "teacher"):
        link = room[f"{role}_url"]
        parts = urlsplit(link)
        assert parts.path == f"/{role}" and parts.query == "" and "token=" not in link.split("#")[0]
        assert link_param(link, "room") == room["room_id"]

        async def get() -> tuple[int, str]:
            async with live.session.get(link) as r:  # the fragment stays with the client
                return r.status, str(r.url)

        status, url = live.run(get())
        assert status == 200 and "token" not in urlsplit(url).query


# Zero-width, format and blank characters (issue 33's probe used U+200B, U+2060, U+3164, U+2800 and U+FEFF).
INVISIBLE = ("\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u3164", "\u2800", "\u115f", "\u1160", "\uffa0",
             "\u180e", "\u2061", "\u00ad", "\u034f", "\ufe0f", "\U000e0041")


def test_student_names_lose_control_and_bidi_characters(live, room):
    teacher = token_of(room["teacher_url"])

    async def join(name: str) -> tuple[int, str | None]:
        """The status of the ingest handshake, and the name the teacher's feed announces."""
        feed_url = f"{live.ws_url}/api/rooms/{room['room_id']}/feed"
        async with live.session.ws_connect(feed_url, params={"token": teacher}) as feed:
            for _ in range(2):  # history, roster
                await feed.receive_json(timeout=10)
            params = {"token": token_of(room["student_url"]), "name": name}
            try:
                async with live.session.ws_connect(f"{live.ws_url}/ws/ingest", params=params) as ws:
                    ready = await ws.receive_json(timeout=10)
                    while (event := await feed.receive_json(timeout=10))["type"] != "student_joined" or \
                            event["student_id"] != ready["student_id"]:
                        pass
                    return 101, event["student_name"]
            except aiohttp.WSServerHandshakeError as error:
                return error.status, None

    assert live.run(join("\u202eAnn\u202c \u0007")) == (101, "Ann")
    assert live.run(join("\u2066Bo\u2069\u200e\u200f\u061c\x1b[31m")) == (101, "Bo[31m")
    assert live.run(join("Li\u0000\u009f\u007fu")) == (101, "Liu")
    assert live.run(join("\u05e9\u05e8\u05d4 Sara")) == (101, "\u05e9\u05e8\u05d4 Sara")  # Hebrew letters stay
    assert live.run(join("Z" * 80 + "\u202e" * 20)) == (101, "Z" * 80)  # counted after stripping
    for empty in ("\u202e\u202c", "\x00\x01\u2066", " \u200e ", "Z" * 81):
        assert live.run(join(empty))[0] == 400, empty

    async def offer(name: str) -> tuple[int, dict]:
        body = {"token": token_of(room["student_url"]), "sdp": "v=0", "type": "offer", "student_name": name}
        async with live.session.post(f"{live.url}/api/rooms/{room['room_id']}/offer", json=body) as r:
            return r.status, await r.json()

    status, answer = live.run(offer("\u202e\u2067"))
    assert status == 400 and "student_name" in answer["error"]

    # Issue 33: zero-width and other invisible characters go too, and a name needs a visible one.
    for invisible in ("".join(INVISIBLE), "\u200b\u2060\u3164\u2800\ufeff", "\u3000\u00a0\u200b", "\u3164", "\u0301"):
        assert live.run(join(invisible))[0] == 400, ascii(invisible)
    assert live.run(join("A\u200bn\u2060n\ufeff\u3164")) == (101, "Ann")
    assert live.run(join("\u2800Bo\u200d")) == (101, "Bo")
    assert live.run(join("Zo\u00eb \u674e")) == (101, "Zo\u00eb \u674e")  # visible letters of any script stay
    status, answer = live.run(offer("\u200b\u3164"))
    assert status == 400 and "visible" in answer["error"]



def test_room_names_lose_what_cannot_be_seen(live):
    """The probe: a name with a lone surrogate reached the Redis client (500) and left a room
    registered that was never saved."""

    async def post(raw: str) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
        async with live.session.post(f"{live.url}/api/rooms", data=raw.encode(), headers=headers) as r:
            return r.status, await r.json()

    rooms_before = len(live.classroom.rooms.rooms)
    status, answer = live.run(post('{"name": "ab\\ud800cd\\u202e"}'))
    assert status == 201 and answer["name"] == "abcd", answer
    for bad in ('{"name": "\\ud800"}', '{"name": "\\u200b\\u202e "}', '{"name": "%s"}' % ("x" * 201), '{"name": 7}'):
        status, answer = live.run(post(bad))
        assert status == 400 and "name must be" in answer["error"], (bad, answer)
    assert len(live.classroom.rooms.rooms) == rooms_before + 1


def test_body_that_does_not_decode_as_its_encoding_says_is_400(live, room):
    """The probe: `Content-Encoding: gzip` on a body that is not gzip raised aiohttp's
    RequestPayloadError through the handler (500, and a traceback in the log)."""

    async def post(url: str, encoding: str) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json",
                   "Content-Encoding": encoding}
        async with live.session.post(url, data=b"xxxx", headers=headers, compress=False) as r:
            return r.status, await r.json()

    for url in (f"{live.url}/api/rooms", f"{live.url}/api/rooms/{room['room_id']}/offer"):
        for encoding in ("gzip", "deflate"):
            status, answer = live.run(post(url, encoding))
            assert status == 400 and "body cannot be read" in answer["error"], (url, encoding, answer)


def test_body_that_stops_coming_is_answered_within_the_header_timeout(live, room, caplog):
    """The probe: a body that never finished held its connection for as long as the client
    liked; a client that then went away left a traceback in the log."""
    head = (b"POST /api/rooms/%s/offer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"tok" % room["room_id"].encode())
    saved = live.settings.header_timeout_s
    live.settings.header_timeout_s = 0.5
    try:
        status, answer = live.run(live.raw_http(head, timeout=5))
        assert status == 408 and b"did not arrive in time" in answer

        async def leave_mid_body() -> None:
            reader, writer = await asyncio.open_connection(live.server.host, live.server.port)
            writer.write(head)
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.transport.abort()
            await asyncio.sleep(0.3)

        with caplog.at_level(logging.INFO):
            live.run(leave_mid_body())
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        live.settings.header_timeout_s = saved


def test_subtitle_origin_out_of_range_is_400(live, room):
    """The probe: origin=-1e308 overflowed in the cue clock (500)."""
    token = live.token(room, "teacher")

    async def get(origin: str) -> tuple[int, dict]:
        url = f"{live.url}/api/rooms/{room['room_id']}/transcript"
        async with live.session.get(url, params={"format": "srt", "origin": origin, "token": token}) as r:
            return r.status, await r.json()

    for origin in ("-1e308", "-1", "1e300", "nan", "inf"):
        status, answer = live.run(get(origin))
        assert status == 400 and "origin must be" in answer["error"], (origin, answer)


def test_offers_aiortc_cannot_use_are_400_with_a_reason(live, room):
    """The probe: an offer without a=fingerprint was answered, then aiortc's DTLS task failed
    in the log; others answered aiortc's internals (or nothing) as the reason."""
    token = token_of(room["student_url"])
    audio = "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\nc=IN IP4 0.0.0.0\r\na=rtpmap:111 opus/48000/2\r\n"

    async def post(sdp: str) -> tuple[int, dict]:
        body = {"token": token, "sdp": sdp, "type": "offer", "student_name": "Ann"}
        async with live.session.post(f"{live.url}/api/rooms/{room['room_id']}/offer", json=body) as r:
            return r.status, await r.json()

    status, answer = live.run(post("v=0\r\n" + audio))
    assert status == 400 and "fingerprint" in answer["error"], answer
    fingerprint = "a=fingerprint:sha-256 " + ":".join(["AB"] * 32) + "\r\n"
    for sdp in ("m=audio garbage\r\n" + fingerprint, "v=0\r\n" + fingerprint + audio + audio):
        status, answer = live.run(post(sdp))
        assert status == 400, (sdp, answer)
        reason = answer["error"].removeprefix("cannot use this offer:").strip()
        assert reason and "NoneType" not in reason and "index" not in reason, answer


def test_aioice_and_aiortc_log_at_warning():
    import streamserver.transport.webrtc  # noqa: F401  (sets the levels on import)

    for name in ("aioice", "aioice.ice", "aiortc"):
        assert logging.getLogger(name).getEffectiveLevel() >= logging.WARNING, name
