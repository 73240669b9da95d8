"""Signed, expiring room tokens: HMAC-SHA256 over a small JSON claim.

A token names one room and one role; the server never stores it. A student token never opens
the teacher's feed and a token of one room never opens another. A per-student link's token also
names its student (`sid`, and the name the platform knows, `nm`): whoever holds it is that student,
so it seats one student whatever its holder does.

Decoding is strict, so that one token has exactly one spelling: only ASCII `body.signature`
in canonical unpadded base64url (anything else, a lone surrogate included, is a 401 and never
an exception), an integer `exp`, string `room` and `role`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from dataclasses import dataclass

from streamserver.rooms.admission import AddressLimits

ROLES = ("teacher", "student")
_TOKEN = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
_MAX_TOKEN_CHARS = 4096  # an issued token is about 150 characters
_MAX_EXP = 2**53  # past any real expiry, and still exact as a float


class TokenError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status  # 401: not a valid token; 403: valid but not for this


@dataclass(frozen=True)
class Claim:
    room_id: str
    role: str
    expires: float
    limits: AddressLimits = AddressLimits()  # what a student link allows one client address
    student_id: str | None = None  # a per-student link's student; None: the room's shared link
    name: str | None = None  # the student's name as the platform knows it (a per-student link)

    def queue_source(self, address: str) -> str:
        """Whose share of the room's recognition queue this link's streams count in
        (queue/fair.py): a per-student link's own; for the shared link, the client's address (a
        school behind one NAT is then one source, as it is one address)."""
        return f"link:{self.student_id}" if self.student_id is not None else address


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    """Canonical unpadded base64url only: the alphabet is checked by the caller, and a text
    whose unused trailing bits are set (several spellings of the same bytes) is refused."""
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(data) != text:
        raise ValueError("not canonical base64url")
    return data


def issue(secret: str, room_id: str, role: str, ttl_s: float, limits: AddressLimits = AddressLimits(),
          student_id: str | None = None, name: str | None = None) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    claim: dict[str, object] = {"room": room_id, "role": role, "exp": int(time.time() + ttl_s)}
    if student_id is not None:
        claim["sid"] = student_id
        if name is not None:
            claim["nm"] = name
    if limits.seats_per_address is not None:
        claim["spa"] = limits.seats_per_address
    if limits.joins_per_minute is not None:
        claim["jpm"] = limits.joins_per_minute
    body = _b64(json.dumps(claim).encode())
    sig = hmac.new(secret.encode(), body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(sig)}"


def _claim(secret: str, token: object) -> Claim:
    """The claim of a genuine token (expired or not), else TokenError 401."""
    if not isinstance(token, str) or len(token) > _MAX_TOKEN_CHARS or not _TOKEN.fullmatch(token):
        raise TokenError("missing or malformed token", 401)
    body, sig = token.split(".")
    expected = hmac.new(secret.encode(), body.encode("ascii"), hashlib.sha256).digest()
    try:
        genuine = hmac.compare_digest(_unb64(sig), expected)
    except ValueError:  # binascii.Error: a length no base64 has, or non-canonical
        raise TokenError("malformed token", 401) from None
    if not genuine:
        raise TokenError("invalid token signature", 401)
    try:  # signed by us, so well formed unless the secret leaked; checked all the same
        data = json.loads(_unb64(body))
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TokenError("malformed token", 401) from None
    if not isinstance(data, dict):
        raise TokenError("malformed token", 401)
    room, role, exp = data.get("room"), data.get("role"), data.get("exp")
    # bool is an int subclass; a float (nan, inf, 1e999) is not an exp we issue
    if not isinstance(room, str) or not isinstance(role, str) or type(exp) is not int or not 0 <= exp <= _MAX_EXP:
        raise TokenError("malformed token", 401)
    spa, jpm = data.get("spa"), data.get("jpm")
    if any(v is not None and (type(v) is not int or v < 1) for v in (spa, jpm)):
        raise TokenError("malformed token", 401)
    sid, nm = data.get("sid"), data.get("nm")
    if any(v is not None and not isinstance(v, str) for v in (sid, nm)) or (sid is None and nm is not None):
        raise TokenError("malformed token", 401)
    return Claim(room, role, float(exp), AddressLimits(spa, jpm), sid, nm)


def verify(secret: str, token: object, room_id: str | None, role: str) -> Claim:
    """The token's claim if it is genuine, unexpired, for this room (None: for the room it
    names, which the caller reads from the claim) and this role."""
    claim = _claim(secret, token)
    if claim.expires < time.time():
        raise TokenError("token expired", 401)
    if room_id is not None and claim.room_id != room_id:
        raise TokenError("token is for another room", 403)
    if claim.role != role:
        raise TokenError(f"a {claim.role} token cannot do this", 403)
    return claim


def bearer(header: str | None) -> bytes | None:
    """The credential of an `Authorization: Bearer <credential>` header as bytes, for
    hmac.compare_digest; None when the header is absent, has another scheme (a bare token
    included) or is not ASCII (aiohttp hands undecodable bytes over as surrogates)."""
    if header is None:
        return None
    try:
        raw = header.encode("ascii")
    except UnicodeEncodeError:
        return None
    scheme, _, credential = raw.partition(b" ")
    credential = credential.strip(b" \t")
    if scheme.lower() != b"bearer" or not credential:
        return None
    return credential


def room_links(secret: str, room_id: str, base_url: str, ttl_s: float, limits: AddressLimits = AddressLimits()) -> dict[str, str]:
    """The teacher and student URLs of a room, each carrying its signed token in the fragment:
    a browser never sends the fragment to a server, so the token reaches no Referer and no
    access log (the pages read it from location.hash)."""
    return {
        f"{role}_url": f"{base_url}/{role}#room={room_id}&token={issue(secret, room_id, role, ttl_s, limits)}" for role in ROLES
    }
