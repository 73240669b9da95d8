"""Signed, expiring room tokens: HMAC-SHA256 over a small JSON claim.

A token names one room and one role; the server never stores it. A student token never opens
the teacher's feed and a token of one room never opens another.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass

ROLES = ("teacher", "student")


class TokenError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status  # 401: not a valid token; 403: valid but not for this


@dataclass(frozen=True)
class Claim:
    room_id: str
    role: str
    expires: float


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue(secret: str, room_id: str, role: str, ttl_s: float) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    body = _b64(json.dumps({"room": room_id, "role": role, "exp": int(time.time() + ttl_s)}).encode())
    sig = hmac.new(secret.encode(), body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(sig)}"


def verify(secret: str, token: object, room_id: str | None, role: str) -> Claim:
    """The token's claim if it is genuine, unexpired, for this room (None: for the room it
    names, which the caller reads from the claim) and this role."""
    if not isinstance(token, str) or token.count(".") != 1:
        raise TokenError("missing or malformed token", 401)
    body, sig = token.split(".")
    expected = hmac.new(secret.encode(), body.encode(), hashlib.sha256).digest()
    try:
        genuine = hmac.compare_digest(_unb64(sig), expected)
        data = json.loads(_unb64(body)) if genuine else None
    except (ValueError, json.JSONDecodeError):
        raise TokenError("malformed token", 401) from None
    if not genuine or not isinstance(data, dict):
        raise TokenError("invalid token signature", 401)
    claim = Claim(str(data.get("room")), str(data.get("role")), float(data.get("exp", 0)))
    if claim.expires < time.time():
        raise TokenError("token expired", 401)
    if room_id is not None and claim.room_id != room_id:
        raise TokenError("token is for another room", 403)
    if claim.role != role:
        raise TokenError(f"a {claim.role} token cannot do this", 403)
    return claim


def room_links(secret: str, room_id: str, base_url: str, ttl_s: float) -> dict[str, str]:
    """The teacher and student URLs of a room, each carrying its signed token."""
    return {
        f"{role}_url": f"{base_url}/{role}?room={room_id}&token={issue(secret, room_id, role, ttl_s)}" for role in ROLES
    }
