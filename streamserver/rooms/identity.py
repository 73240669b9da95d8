"""Who a student is: the server issues every student_id, with a signed resume secret.

A student link is shared by the whole class, so an id the client names proves nothing: anyone
who learned another student's id could take over that student. The server therefore picks the
id of every new student and hands out, with it, `resume` = HMAC(secret, room, id). A reconnect
that presents both keeps its identity (and its seat); a client that names an id without its
secret, or with a wrong one, is a new student with a new id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    student_id: str
    resume: str
    resumed: bool  # the client proved it is this student (a reconnect)


def _resume_secret(secret: str, room_id: str, student_id: str) -> str:
    mac = hmac.new(secret.encode(), f"resume\0{room_id}\0{student_id}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def identify(secret: str, room_id: str, student_id: object, resume: object) -> Identity:
    """The client's own identity when it proves it, else a new one."""
    if isinstance(student_id, str) and isinstance(resume, str) and student_id.isascii() and resume.isascii():
        expected = _resume_secret(secret, room_id, student_id)
        if hmac.compare_digest(resume.encode(), expected.encode()):
            return Identity(student_id, expected, True)
    fresh = secrets.token_hex(8)
    return Identity(fresh, _resume_secret(secret, room_id, fresh), False)


def bound(secret: str, room_id: str, student_id: str) -> Identity:
    """The identity of a per-student link's holder: the link names it, and holding the link proves
    it (rooms/tokens.py)."""
    return Identity(student_id, _resume_secret(secret, room_id, student_id), True)
