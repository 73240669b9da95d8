"""Per-student links: each one seats one student, whatever its holder does.

The room's shared student link lets anyone who holds it be any number of new students. A
per-student link's token names its student (rooms/tokens.py), so every join with it, however many
at once and under whatever name, is that one student: a second connection replaces the first
(close 4001) and keeps its seat. The platform asks for them when it creates the room, or later for
an existing room (api/app.py): `"student_links": N` (ids the server picks) or `"students": [{"id":
..., "name": ...}]` (identities the platform already has; the name, when given, is the one shown).
A room created with per-student links hands out no shared student link.

Joins of one student go in one at a time (JoinOrder), so that each finds the one before it
connected, and ends it, rather than two being seated side by side and one left open.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
from typing import AsyncIterator

from streamserver.rooms import names, tokens

STUDENT_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")  # a platform's own id, as it is put in the token
MAX_LINKS = 1000  # a request's: a lecture asks in several


class LinkRequestError(ValueError):
    """The request for per-student links cannot be met (the message says why)."""


def requested(body: dict) -> list[tuple[str, str | None]] | None:
    """The students (id, name or None) a room API body asks per-student links for; None: none asked."""
    count, students = body.get("student_links"), body.get("students")
    if count is not None and students is not None:
        raise LinkRequestError("ask for student_links (a number) or students (a list), not both")
    if count is not None:
        if type(count) is not int or not 1 <= count <= MAX_LINKS:
            raise LinkRequestError(f"student_links must be a whole number from 1 to {MAX_LINKS}")
        return [(secrets.token_hex(8), None) for _ in range(count)]
    if students is None:
        return None
    if not isinstance(students, list) or not 1 <= len(students) <= MAX_LINKS:
        raise LinkRequestError(f"students must be a list of 1 to {MAX_LINKS} {{\"id\": ..., \"name\": ...}}")
    wanted: list[tuple[str, str | None]] = []
    for student in students:
        student_id = student.get("id") if isinstance(student, dict) else None
        if not isinstance(student_id, str) or not STUDENT_ID.fullmatch(student_id):
            raise LinkRequestError("each student's id must be 1 to 64 letters, digits or . _ : @ -")
        name = student.get("name")
        try:
            wanted.append((student_id, None if name is None else names.clean(name, "a student's name")))
        except names.BadName as error:
            raise LinkRequestError(str(error)) from None
    if len({student_id for student_id, _ in wanted}) < len(wanted):
        raise LinkRequestError("each student's id must be given once")
    return wanted


def mint(secret: str, room_id: str, base_url: str, ttl_s: float, students: list[tuple[str, str | None]]) -> list[dict]:
    """A link for each student, the token in the URL's fragment as the room's own links."""
    return [{"student_id": student_id, **({"name": name} if name is not None else {}),
             "student_url": f"{base_url}/student#room={room_id}&token="
                            f"{tokens.issue(secret, room_id, 'student', ttl_s, student_id=student_id, name=name)}"}
            for student_id, name in students]


class JoinOrder:
    """One join at a time for each student of a room."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def of(self, room_id: str, student_id: str) -> AsyncIterator[None]:
        key = (room_id, student_id)
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
