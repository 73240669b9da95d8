"""Rooms and their students, in this process. With several gateways each keeps the students
seated through it; a room's name and language are shared through the bus (rooms/directory.py),
and so are its seats: the student limit is counted on the bus, for the whole room
(Bus.take_seat); rooms/seats.py raises RoomFull when the room has no seat left."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

LANGUAGES = ("en", "zh", "auto")


class RoomFull(Exception):
    pass


@dataclass
class Student:
    student_id: str
    name: str
    speaking: bool = False


@dataclass
class Room:
    room_id: str
    name: str
    language: str
    max_students: int
    students: dict[str, Student] = field(default_factory=dict)

    def roster(self) -> list[dict]:
        return [{"student_id": s.student_id, "student_name": s.name, "speaking": s.speaking} for s in self.students.values()]


class RoomRegistry:
    def __init__(self, max_students: int) -> None:
        self.max_students = max_students
        self.rooms: dict[str, Room] = {}

    def create(self, name: str, language: str, max_students: int | None = None) -> Room:
        """A new room, with its own student limit (a lecture's thousands) or this process's."""
        room = Room(secrets.token_urlsafe(8), name, language, max_students or self.max_students)
        self.rooms[room.room_id] = room
        return room

    def adopt(self, room_id: str, name: str, language: str, max_students: int | None = None) -> Room:
        """A room created by another process of the deployment, seated here from now on, with the
        student limit it was created with (this process's own for a record that has none)."""
        limit = max_students if max_students is not None else self.max_students
        return self.rooms.setdefault(room_id, Room(room_id, name, language, limit))

    def get(self, room_id: str) -> Room | None:
        return self.rooms.get(room_id)

    def join(self, room: Room, student_id: str, name: str) -> tuple[Student, bool]:
        """The student, and whether they are new (a reconnect keeps its seat and identity). The
        caller has taken the student's seat on the bus: the limit is counted there."""
        if student_id in room.students:
            student = room.students[student_id]
            student.name = name
            return student, False
        student = Student(student_id, name)
        room.students[student_id] = student
        return student, True

    def leave(self, room: Room, student_id: str) -> Student | None:
        return room.students.pop(student_id, None)
