"""aiohttp application: every client-facing route, each answer a clear status and message.

Nothing a client sends may crash the process: bad JSON or SDP is a 400, a bad token 401/403,
a body over the limit 413 (aiohttp's own check), a full room 429 (the whole room, across
gateways), the bus unreachable 503.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web
from aiohttp.http_exceptions import HttpProcessingError

from streamserver.api.feed_socket import feed_socket
from streamserver.api.ice_config import config_handler
from streamserver.api.probes import add_livez
from streamserver.logs import fields
from streamserver.asr.worker import AsrWorker
from streamserver.audio.timeline import CLOCK_NAME
from streamserver.bus.redis import BusError
from streamserver.classroom import Classroom
from streamserver.events import History, QuestionGroupAnsweredEvent, RoomClosedEvent, Roster, event_type
from streamserver.metrics import CONTENT_TYPE, Metrics
from streamserver.queue.base import UNREACHABLE
from streamserver.queue.sink import Busy
from streamserver.rooms import links, names, tokens, transcript
from streamserver.rooms.identity import Identity, bound
from streamserver.rooms.idle import IdleStreams
from streamserver.rooms.offers import OfferLimits, TooManyOffers
from streamserver.rooms.admission import AddressLimits, TooManyFromAddress
from streamserver.rooms.directory import RoomClosed
from streamserver.rooms.feed import DashboardFeed
from streamserver.rooms.identity import identify
from streamserver.transport.ws_ingest import CLOSE_ROOM_CLOSED
from streamserver.rooms.registry import LANGUAGES, Room, RoomFull
from streamserver.transport import ws_ingest
from streamserver.transport.webrtc import OfferError
from streamserver import subtitles, webrtc_join

log = logging.getLogger(__name__)
WEB_DEMO = Path(__file__).resolve().parents[1] / "web_demo"  # package data
CLASSROOM = web.AppKey("classroom", Classroom)
# The in-process ASR worker of `serve` (absent on a gateway): /healthz reports on it.
WORKER = web.AppKey("worker", AsrWorker)
# What bounds one client (issue 33): its joins one at a time per student, idle streams ended,
# offers counted (rooms/links.py, rooms/idle.py, rooms/offers.py).
JOINS = web.AppKey("joins", links.JoinOrder)
IDLE = web.AppKey("idle", IdleStreams)
OFFERS = web.AppKey("offers", OfferLimits)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object, read within --header-timeout: aiohttp times out a request's
    head, not a body that stops coming, which would hold the connection for as long as its
    sender likes."""
    try:
        async with asyncio.timeout(request.app[CLASSROOM].settings.header_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=json.dumps({"error": "the request's body did not arrive in time"}),
                                     content_type="application/json", headers={"Connection": "close"}) from None
    except web.RequestPayloadError as error:  # a body that does not decode as its Content-Encoding says
        raise web.HTTPBadRequest(text=json.dumps({"error": f"body cannot be read: {error}"}),
                                 content_type="application/json") from None
    try:
        body = json.loads(raw.decode(request.charset or "utf-8"))
    # ValueError: bad JSON, bad UTF-8 or a number too long; RecursionError: nesting too deep;
    # LookupError: a charset Python does not know
    except (ValueError, RecursionError, LookupError):
        raise web.HTTPBadRequest(text=json.dumps({"error": "body is not valid JSON"}), content_type="application/json")
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": "body must be a JSON object"}), content_type="application/json")
    return body


async def _find_room(classroom: Classroom, room_id: str) -> Room:
    """The room, or the HTTP answer: 404 unknown (or expired), 403 closed, 503 bus unreachable."""
    try:
        room = await classroom.directory.find(room_id)
    except RoomClosed as error:
        raise web.HTTPForbidden(text=json.dumps({"error": str(error)}), content_type="application/json") from None
    except BusError as error:
        raise web.HTTPServiceUnavailable(text=json.dumps({"error": str(error)}), content_type="application/json") from error
    if room is None:
        raise web.HTTPNotFound(text=json.dumps({"error": "no such room"}), content_type="application/json")
    return room


async def _room(request: web.Request) -> Room:
    """The path's room. Routes ask only once the token (or the admin's) is checked against the
    path's room id, which needs no lookup: a request without one is answered 401/403 alike for
    a room that exists and one that does not, so the answers do not say which rooms exist, and
    it costs no Redis call."""
    return await _find_room(request.app[CLASSROOM], request.match_info["room_id"])


def _is_admin(request: web.Request) -> bool:
    admin = request.app[CLASSROOM].settings.admin_token
    given = tokens.bearer(request.headers.get("Authorization"))  # bytes: compare_digest takes no non-ASCII str
    return bool(admin) and given is not None and hmac.compare_digest(given, admin.encode("utf-8", "surrogatepass"))


async def close_room(request: web.Request) -> web.Response:
    """DELETE /api/rooms/<id>, by an admin or the room's teacher (Authorization: Bearer): every
    session of the room ends and its links stop opening it, on every gateway (the teacher's link
    still exports the class transcript until the link expires: class_transcript)."""
    if (denied := _unless_teacher(request, request.match_info["room_id"])) is not None:
        return denied
    room = await _room(request)
    try:
        await request.app[CLASSROOM].upkeep.close_room(room)
    except BusError as error:
        return _error(503, f"room not closed: {error}")
    return web.json_response({"room_id": room.room_id, "closed": True})


def _unless_teacher(request: web.Request, room_id: str) -> web.Response | None:
    """The error answer unless an admin or the room's teacher asks (Authorization: Bearer)."""
    if _is_admin(request):
        return None
    given = tokens.bearer(request.headers.get("Authorization"))
    teacher = given.decode("ascii", "replace") if given is not None else None
    return _check_token(request, room_id, teacher, "teacher")


ORIGIN_MAX = 1e10  # a subtitle origin past this (the year 2286) is not a recording's start
GROUP_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")  # as AsrWorker makes them: <worker>.<run>:<n>


async def question_group_answered(request: web.Request) -> web.Response:
    """POST /api/rooms/<id>/question_groups/<group id>/answered, by the room's teacher (or an
    admin; Authorization: Bearer): a question_group_answered event to the room, so that each of
    its dashboards shows the group answered (until a question joins it again: the group's next
    question_group event is open). The groups live in the workers: the id is not looked up."""
    room_id, group_id = request.match_info["room_id"], request.match_info["group_id"]
    if (denied := _unless_teacher(request, room_id)) is not None:
        return denied
    if not GROUP_ID.fullmatch(group_id):
        return _error(400, "not a question group id")
    room = await _room(request)
    if not await request.app[CLASSROOM].publisher.publish(QuestionGroupAnsweredEvent(room.room_id, group_id)):
        return _error(503, "the room's bus did not take the event")
    return web.json_response({"room_id": room.room_id, "group_id": group_id, "answered": True})


def _check_token(request: web.Request, room_id: str, token: str | None, role: str) -> web.Response | None:
    """The error answer for a token that is not `role`'s for this room; None for one that is (the
    token names its room: no lookup in the directory, which a closed room has left)."""
    try:
        tokens.verify(request.app[CLASSROOM].settings.secret, token, room_id, role)
    except tokens.TokenError as error:
        return _error(error.status, str(error))
    return None


async def create_room(request: web.Request) -> web.Response:
    classroom = request.app[CLASSROOM]
    settings = classroom.settings
    if not settings.admin_token:
        return _error(403, "room creation is disabled: set STREAMSERVER_ADMIN_TOKEN")
    if not _is_admin(request):
        return _error(401, "admin token required (Authorization: Bearer <token>)")
    body = await _json_body(request)
    language = body.get("language", "en")
    try:  # the teacher's page shows it: what cannot be seen (bidi overrides, lone surrogates) is removed
        name = names.clean(body.get("name"), "name", ROOM_NAME_MAX)
    except names.BadName as error:
        return _error(400, str(error))
    if language not in LANGUAGES:
        return _error(400, f"language must be one of {', '.join(LANGUAGES)}")
    if language != "en" and (worker := request.app.get(WORKER)) is not None and not worker.engine.multilingual:
        return _error(400, f"this server runs the English-only model {worker.engine.model}; start it with --model base")
    limits = {}
    for field in ("seats_per_address", "joins_per_minute"):
        value = body.get(field)
        if value is not None and (type(value) is not int or not 1 <= value <= 10_000):
            return _error(400, f"{field} must be a whole number from 1 to 10000 (or absent: no limit)")
        limits[field] = value
    size = body.get("max_students")
    if size is not None and (type(size) is not int or not 1 <= size <= ROOM_SIZE_MAX):
        return _error(400, f"max_students must be a whole number from 1 to {ROOM_SIZE_MAX} (or absent: the server's "
                           f"{settings.max_students})")
    try:
        students = links.requested(body)
    except links.LinkRequestError as error:
        return _error(400, str(error))
    try:
        room = await classroom.directory.create(name, language, size)
    except BusError as error:
        return _error(503, f"room not created: {error}")
    base = settings.public_url or f"{request.scheme}://{request.host}"
    answer = {"room_id": room.room_id, "name": room.name, "language": room.language,
              **tokens.room_links(settings.secret, room.room_id, base, settings.token_ttl_s, AddressLimits(**limits))}
    if students is not None:  # per-student links, and no shared one
        del answer["student_url"]
        answer["student_links"] = links.mint(settings.secret, room.room_id, base, settings.token_ttl_s, students)
    return web.json_response(answer, status=201)


async def student_links(request: web.Request) -> web.Response:
    """POST /api/rooms/<id>/student_links, by an admin: more per-student links for a room
    (rooms/links.py), {"student_links": N} or {"students": [{"id", "name"}]}."""
    if not _is_admin(request):
        return _error(401, "admin token required (Authorization: Bearer <token>)")
    room = await _room(request)
    try:
        students = links.requested(await _json_body(request))
    except links.LinkRequestError as error:
        return _error(400, str(error))
    if students is None:
        return _error(400, "ask for student_links (a number) or students (a list of {\"id\", \"name\"})")
    settings = request.app[CLASSROOM].settings
    base = settings.public_url or f"{request.scheme}://{request.host}"
    return web.json_response({"room_id": room.room_id, "student_links": links.mint(
        settings.secret, room.room_id, base, settings.token_ttl_s, students)}, status=201)


def _who(request: web.Request, room: Room, claim: tokens.Claim, query: Any, name: object, name_field: str) -> tuple[Identity, str]:
    """The joining student and its name: a per-student link's own (its name, when the link has one),
    else the identity the client proves or a new one (rooms/identity.py) and the name it gives."""
    secret = request.app[CLASSROOM].settings.secret
    if claim.student_id is not None:
        return bound(secret, room.room_id, claim.student_id), _student_name(claim.name or name, name_field)
    return identify(secret, room.room_id, query.get("student_id"), query.get("resume")), _student_name(name, name_field)


def _student_name(name: object, name_field: str) -> str:
    """The student's display name, cleaned (rooms/names.py)."""
    try:
        return names.clean(name, name_field)
    except names.BadName as error:
        raise web.HTTPBadRequest(text=json.dumps({"error": str(error)}), content_type="application/json") from None


async def offer(request: web.Request) -> web.Response:
    body = await _json_body(request)
    try:
        claim = tokens.verify(request.app[CLASSROOM].settings.secret, body.get("token"), request.match_info["room_id"], "student")
    except tokens.TokenError as error:
        return _error(error.status, str(error))
    room = await _room(request)
    sdp = body.get("sdp")
    if not isinstance(sdp, str) or body.get("type", "offer") != "offer":
        return _error(400, "expected {'sdp': <offer>, 'type': 'offer'}")
    student, name = _who(request, room, claim, body, body.get("student_name", ""), "student_name")
    try:  # a shared link is counted as one, a per-student link as its student
        request.app[OFFERS].check(request.remote or "", claim.student_id or str(body.get("token")))
    except TooManyOffers as error:
        response = _error(429, str(error))
        response.headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
        return response
    keeps = body.get("recovery")  # the page keeps its audio (transport/recovery.py)
    if keeps is not None and not (isinstance(keeps, dict) and isinstance(keeps.get("catch_up", False), bool)
                                  and CLOCK_NAME.fullmatch(str(keeps.get("clock", "")))):
        return _error(400, "recovery must be {'catch_up': true|false, 'clock': up to 64 letters, digits, - or _}")
    try:
        async with request.app[JOINS].of(room.room_id, student.student_id):
            answer = await webrtc_join.connect_student(request.app[CLASSROOM], room, student.student_id, name, sdp,
                                                       request.remote or "", claim.limits, keeps, student.resumed,
                                                       request.app[IDLE].watch, claim.queue_source(request.remote or ""))
    except (RoomFull, TooManyFromAddress) as error:
        return _error(429, str(error))
    except Busy as error:
        return busy_response(str(error))
    except BusError as error:  # the room's seats could not be counted
        return _error(503, str(error))
    except OfferError as error:
        return _error(400, str(error))
    log.info("student joined over WebRTC", extra=fields(room_id=room.room_id, student_id=student.student_id))
    return web.json_response({"sdp": answer, "type": "answer", "student_id": student.student_id, "resume": student.resume,
                              "recovery": keeps is not None})


async def ingest(request: web.Request) -> web.StreamResponse:
    """A student's audio over a WebSocket (streamserver/transport/ws_ingest.py): the offer's
    checks, answered as HTTP statuses before the upgrade. The URL needs no room: the token
    names it (an optional `room` must match it)."""
    classroom = request.app[CLASSROOM]
    try:
        claim = tokens.verify(classroom.settings.secret, request.query.get("token"), request.query.get("room"), "student")
    except tokens.TokenError as error:
        return _error(error.status, str(error))
    room = await _find_room(classroom, claim.room_id)
    student, name = _who(request, room, claim, request.query, request.query.get("name"), "name")
    ws = ws_ingest.new_socket()
    if not ws.can_prepare(request).ok:  # checked before a seat is taken or anyone is told
        return _error(400, "this route takes a WebSocket upgrade")
    student_id = student.student_id
    catch_up = request.query.get("catch_up") == "1"  # a client that keeps its audio sends it again
    end = ws_ingest.Ender(ws)
    try:
        async with request.app[JOINS].of(room.room_id, student_id):
            audio = await classroom.open_stream(room, student_id, name, request.remote or "", end, claim.limits,
                                                ws.send_json, catch_up, student.resumed, claim.queue_source(request.remote or ""))
    except (RoomFull, TooManyFromAddress) as error:
        return _error(429, str(error))
    except Busy as error:
        return busy_response(str(error))
    except BusError as error:
        return _error(503, str(error))
    log.info("student joined over WebSocket", extra=fields(room_id=room.room_id, student_id=student_id))
    try:
        identity = {"room_id": room.room_id, "student_id": student_id, "resume": student.resume}
        async def keep(times: dict) -> None:
            audio.keep(False, times["start"], times["live_from"], times["now"], times["clock"])
            if catch_up and times["live_from"] is not None:
                log.info("student %s sends %.1f s of its audio again", student_id, times["live_from"] - times["start"])
                audio.already_sent(await classroom.parking.sent_before(room.room_id, student_id, times["clock"]))

        return await ws_ingest.serve(request, ws, identity, request.app[IDLE].watch(audio),
                                     lambda: classroom.is_current(room, student_id, audio), keep, end)
    finally:
        audio.said_bye = ws_ingest.said_goodbye(ws)
        classroom.close_stream(room, student_id, audio)  # flushes the last utterance (or keeps it for the client)


async def class_transcript(request: web.Request) -> web.Response:
    """The whole class's final transcripts for its teacher (teacher token in `token` or as a
    Bearer header) or an admin (Bearer): ?format=json (default), csv, txt, or subtitles srt or vtt
    (&origin=<the recording's start, Unix seconds>), as a download; &student=<id>: one student's. Also
    once the room is closed or forgotten: the transcript is kept for its own retention
    (--transcript-retention-days), and the class's end is when a teacher wants it most."""
    classroom = request.app[CLASSROOM]
    room_id = request.match_info["room_id"]
    if not _is_admin(request):
        credential = tokens.bearer(request.headers.get("Authorization"))
        token = request.query.get("token") or (credential.decode() if credential else None)
        if (denied := _check_token(request, room_id, token, "teacher")) is not None:
            return denied
    try:
        room = await classroom.directory.find(room_id)
    except RoomClosed:
        room = None
    except BusError as error:
        return _error(503, str(error))
    fmt = request.query.get("format", "json")
    kinds = {**transcript.FORMATS, **subtitles.FORMATS}
    if fmt not in kinds:
        return _error(400, f"format must be one of {', '.join(kinds)}")
    try:  # subtitles: the recording's start, Unix seconds (subtitles.py)
        origin = float(request.query["origin"]) if "origin" in request.query else None
        if origin is not None and not 0 <= origin <= ORIGIN_MAX:  # NaN too
            raise ValueError(origin)
    except ValueError:
        return _error(400, f"origin must be the recording's start in Unix seconds (0 to {ORIGIN_MAX:.0f})")
    try:
        events = await classroom.bus.transcript(room_id)
    except BusError as error:
        return _error(503, str(error))
    if room is None and not events:
        return _error(404, "no such room, or no transcript of it is kept (none was spoken, or its retention has passed)")
    name = room.name if room is not None else room_id  # a closed room's name is gone with it
    finals = transcript.finals(events)
    if student := request.query.get("student"):  # one student's words only
        finals = [t for t in finals if t["student_id"] == student]
    if fmt in subtitles.FORMATS:
        body = subtitles.render(finals, fmt, origin)
    else:
        body = transcript.render({"room_id": room_id, "name": name}, finals, fmt)
    filename = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or room_id
    return web.Response(text=body, content_type=kinds[fmt], charset="utf-8",
                        headers={"Content-Disposition": f'attachment; filename="{filename}-transcript.{fmt}"'})


async def feed(request: web.Request) -> web.StreamResponse:
    """The teacher's live feed: history first, then the roster, then events as they happen."""
    if (denied := _check_token(request, request.match_info["room_id"], request.query.get("token"), "teacher")) is not None:
        return denied
    room = await _room(request)
    ws = feed_socket()
    await ws.prepare(request)
    async with request.app[CLASSROOM].feed(room.room_id) as events:
        sending: asyncio.Task | None = None
        try:  # whatever fails from here (the bus, the teacher closing the tab), the subscription ends
            history = await events.history()
            await ws.send_str(History(history).to_json())
            if any(e.get("type") == RoomClosedEvent.type for e in history):  # closed while this feed was opening
                await ws.close(code=CLOSE_ROOM_CLOSED, message=b"the room was closed")
                return ws
            await ws.send_str(Roster(room.name, await events.roster(room)).to_json())
            sending = asyncio.create_task(_send(ws, events))
            async for message in ws:  # the dashboard sends nothing we act on; this waits for close
                if message.type == WSMsgType.ERROR:
                    break
        except (BusError, ConnectionError) as error:
            log.warning("feed of room %s ended: %s", room.room_id, error)
            await ws.close()
        finally:
            if sending is not None:
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
    return ws


BUS_PING_S = 2.0
ROOM_NAME_MAX = 200
ROOM_SIZE_MAX = 100_000  # a room's own student limit (a lecture); the server's --max-students is the default


async def _send(ws: web.WebSocketResponse, events: DashboardFeed) -> None:
    async for event in events.live():
        await ws.send_str(event)
        if event_type(event) == RoomClosedEvent.type:
            await ws.close(code=CLOSE_ROOM_CLOSED, message=b"the room was closed")
            return
    await ws.close()  # the bus dropped us: closing lets the dashboard reconnect and replay


def busy_response(reason: str) -> web.Response:
    """503 with Retry-After: the class is not full, the transcription workers are."""
    response = web.json_response({"error": "busy", "detail": reason, "retry_after_s": 10}, status=503)
    response.headers["Retry-After"] = "10"
    return response


async def _bus_answers(classroom: Classroom) -> bool:
    try:  # a cut uplink often answers nothing at all: a health check must not hang on it
        return await asyncio.wait_for(classroom.bus.ping(), BUS_PING_S)
    except asyncio.TimeoutError:
        return False


async def healthz(request: web.Request) -> web.Response:
    """Alive and able to reach the bus; a gateway with a fallback model is healthy without it
    (it transcribes its class itself: a container must not be restarted for an uplink outage)."""
    classroom = request.app[CLASSROOM]
    bus_ok = await _bus_answers(classroom)
    body = {"ok": bus_ok, "bus": "ok" if bus_ok else "unreachable", "rooms": len(classroom.rooms.rooms)}
    if classroom.transcripts is not None:
        body.update(transcripts=classroom.transcripts)
    if (worker := request.app.get(WORKER)) is not None:
        body.update(model=worker.engine.model, queue=await classroom.sink.depth(), transcribed=worker.transcribed)
    return web.json_response(body, status=200 if bus_ok or classroom.transcripts is not None else 503)


async def readyz(request: web.Request) -> web.Response:
    """Ready to take students: the bus answers, a worker can transcribe, and neither this process
    nor recognition is at its capacity (capacity.py)."""
    classroom = request.app[CLASSROOM]
    if not await _bus_answers(classroom):
        return web.json_response({"ready": False, "reason": "bus unreachable"}, status=503)
    try:
        workers, _rate = await classroom.sink.queue.capacity()
    except UNREACHABLE as error:
        return web.json_response({"ready": False, "reason": f"job queue unreachable: {error}"}, status=503)
    if workers == 0:
        return web.json_response({"ready": False, "reason": "no ASR worker is running"}, status=503)
    if reason := await classroom.capacity.refuse(None):  # a load balancer sends new students elsewhere
        return web.json_response({"ready": False, "reason": reason}, status=503)
    return web.json_response({"ready": True})


async def metrics(request: web.Request) -> web.Response:
    """Behind the admin token: the metrics name every room. `--metrics-port` serves them without
    it on an internal address."""
    if not _is_admin(request):
        return _error(401, "metrics need the admin token (Authorization: Bearer <token>), or use --metrics-port")
    return metrics_response(request.app[CLASSROOM].metrics)


def metrics_response(metrics: Metrics) -> web.Response:
    return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def metrics_app(metrics: Metrics) -> web.Application:
    """/metrics alone, without the token: for `--metrics-port` on an internal address."""

    async def handler(request: web.Request) -> web.Response:
        return metrics_response(metrics)

    app = web.Application()
    app.router.add_get("/metrics", handler)
    return app


async def ca_certificate(request: web.Request) -> web.StreamResponse:
    """The classroom CA of `--tls-self-signed`, for students' devices to trust once."""
    path = request.app[CLASSROOM].settings.tls_ca_cert
    if not path:
        return _error(404, "this server has no classroom certificate authority (it is not started with --tls-self-signed)")
    return web.FileResponse(path, headers={"Content-Type": "application/x-x509-ca-cert",
                                           "Content-Disposition": 'attachment; filename="streamserver-classroom-ca.crt"'})


async def ca_page(request: web.Request) -> web.Response:
    path = request.app[CLASSROOM].settings.tls_ca_cert
    if not path:
        return _error(404, "this server has no classroom certificate authority (it is not started with --tls-self-signed)")
    from streamserver.tls import fingerprint

    page = (WEB_DEMO / "ca.html").read_text().replace("{fingerprint}", fingerprint(Path(path)))
    return web.Response(text=page, content_type="text/html")


def _page(name: str):
    async def handler(request: web.Request) -> web.FileResponse:
        return web.FileResponse(WEB_DEMO / name)

    return handler


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every failure answers JSON with a message; an unexpected one is logged, never fatal."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.content_type == "application/json" or error.status < 400:
            raise
        return _error(error.status, error.reason)
    except ConnectionResetError:  # the client went away mid-request: nothing of ours broke (the answer goes nowhere)
        log.info("request %s %s: the client went away before it was answered", request.method, request.path)
        return _error(400, "the connection was lost before the request was read")
    except Exception:
        log.exception("request %s %s failed", request.method, request.path)
        return _error(500, "internal error")


# On every response. The pages' URLs carry tokens (in the fragment now; old links in the query):
# no Referer ever leaves them. The CSP allows the pages' own files and connections only (their
# WebSockets included: 'self' matches ws:/wss: of the same host), no inline script or style
# (web_demo/ has none), the data: favicon, and no framing.
SECURITY_HEADERS = {
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; media-src 'self' blob:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
}


@web.middleware
async def security_headers(request: web.Request, handler):
    """SECURITY_HEADERS on every answer: returned, raised (an HTTPException is a response) or
    static. A WebSocket's 101 has been sent by the time its handler returns."""
    try:
        response = await handler(request)
    except web.HTTPException as error:
        error.headers.update(SECURITY_HEADERS)
        raise
    if not response.prepared:
        response.headers.update(SECURITY_HEADERS)
    return response


class QuietParserErrors(logging.Filter):
    """aiohttp logs every request its parser refuses (it has answered 400 by then) at ERROR, with
    a traceback quoting the offending header, which may hold a token: one INFO line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], HttpProcessingError):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args, record.exc_info, record.exc_text = "refused a malformed HTTP request (400)", (), None, None
        return True


def create_app(classroom: Classroom, worker: AsrWorker | None = None) -> web.Application:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, QuietParserErrors) for f in server_log.filters):
        server_log.addFilter(QuietParserErrors())
    app = web.Application(client_max_size=classroom.settings.max_body_bytes, middlewares=[security_headers, json_errors])
    app[CLASSROOM] = classroom
    if worker is not None:
        app[WORKER] = worker
    app[JOINS] = links.JoinOrder()
    app[IDLE] = IdleStreams(classroom.connections, classroom.settings.idle_seat_s)
    app[OFFERS] = OfferLimits(classroom.settings.offers_per_minute)
    app.router.add_post("/api/rooms", create_room)
    app.router.add_post("/api/rooms/{room_id}/student_links", student_links)
    app.router.add_delete("/api/rooms/{room_id}", close_room)
    app.router.add_post("/api/rooms/{room_id}/question_groups/{group_id}/answered", question_group_answered)
    app.router.add_post("/api/rooms/{room_id}/offer", offer)
    app.router.add_get("/api/rooms/{room_id}/feed", feed)
    app.router.add_get("/api/rooms/{room_id}/transcript", class_transcript)
    app.router.add_get("/ws/ingest", ingest)
    app.router.add_get("/api/config", config_handler(classroom.settings))  # token holders only (api/ice_config.py)
    app.router.add_get("/healthz", healthz)
    add_livez(app)  # answers without the bus: for liveness probes (api/probes.py)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/student", _page("student.html"))
    app.router.add_get("/teacher", _page("teacher.html"))
    app.router.add_get("/ca.crt", ca_certificate)
    app.router.add_get("/ca", ca_page)
    app.router.add_static("/static/", WEB_DEMO)

    async def on_startup(app: web.Application) -> None:
        await classroom.start()
        classroom.tasks.spawn(app[IDLE].run())

    async def on_cleanup(app: web.Application) -> None:
        await classroom.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
