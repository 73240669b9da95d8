"""`GET /api/config`: the ICE servers a page gives its RTCPeerConnection, for token holders only.

TURN credentials let whoever holds them relay traffic through the school's TURN server, so this
route answers only a valid room token, a student's or a teacher's (the pages have theirs in the
link): `Authorization: Bearer <token>` (what the pages send: no access log sees it) or
`?token=`. Without one, or with one that is expired, forged or malformed, the answer is 401 and
carries no ICE server at all. With `--turn-url` and a TURN secret, each answer adds a TURN
server whose credential is minted for this request and expires after `--turn-ttl`
(streamserver/turn.py).
"""

from __future__ import annotations

from aiohttp import web

from streamserver import turn
from streamserver.config import Settings
from streamserver.rooms import tokens


def _claim(settings: Settings, request: web.Request) -> tokens.Claim:
    """The claim of the request's student or teacher token; TokenError when it has none valid."""
    header = tokens.bearer(request.headers.get("Authorization"))
    token = header.decode("ascii") if header is not None else request.query.get("token")
    for role in tokens.ROLES:
        try:
            return tokens.verify(settings.secret, token, None, role)
        except tokens.TokenError as error:
            if error.status != 403:  # 403 is only "the other role": try it
                raise
    raise tokens.TokenError("not a room token", 401)


def ice_servers(settings: Settings, claim: tokens.Claim) -> list[dict]:
    """The configured ICE servers, and a freshly minted TURN server where one is set up."""
    servers = [dict(server) for server in settings.ice_servers]
    if settings.turn_urls and settings.turn_secret:
        servers.append(turn.mint(settings.turn_secret, settings.turn_urls, settings.turn_ttl_s, claim.student_id))
    return servers


def config_handler(settings: Settings):  # noqa: ANN201 - an aiohttp handler
    async def config(request: web.Request) -> web.Response:
        try:
            claim = _claim(settings, request)
        except tokens.TokenError as error:
            return web.json_response({"error": f"a room token is required (Authorization: Bearer <token>): {error}"},
                                     status=401)
        # minted per request: no cache may keep one for another holder, or past its expiry
        return web.json_response({"ice_servers": ice_servers(settings, claim)}, headers={"Cache-Control": "no-store"})

    return config
