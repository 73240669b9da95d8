"""The live connections of one process: for each seated student, its transport's end, its audio
pipeline, its client's address and, for a client that keeps its audio, how to tell it things."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Awaitable, Callable

from streamserver.audio.pipeline import StudentAudio

# Ends a transport from the server's side, telling the client why: a WebSocket close code; a
# WebRTC page on its recovery channel, if one is open, when it was replaced or its room closed.
End = Callable[[str, int], Awaitable[None]]

# A message to a client that keeps its audio (an ack): its recovery data channel (which says
# whether it was open to send it) or its WebSocket.
Tell = Callable[[dict], Awaitable[bool | None]]


@dataclass
class Connection:
    end: End
    audio: StudentAudio
    address: str
    tell: Tell | None = None


class Connections(dict[tuple[str, str], Connection]):
    """(room id, student id) -> the student's connection here. The students of a room per client
    address are counted as connections come and go, so that a join's per-address check costs the
    same in a lecture of thousands as in a class of thirty."""

    def __init__(self) -> None:
        super().__init__()
        self._per_address: Counter[tuple[str, str]] = Counter()

    def __setitem__(self, key: tuple[str, str], connection: Connection) -> None:
        self.pop(key, None)
        super().__setitem__(key, connection)
        self._per_address[(key[0], connection.address)] += 1

    def __delitem__(self, key: tuple[str, str]) -> None:
        self.pop(key)

    def pop(self, key: tuple[str, str], *default: Connection | None) -> Connection | None:  # type: ignore[override]
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        connection = super().pop(key)
        counted = (key[0], connection.address)
        self._per_address[counted] -= 1
        if self._per_address[counted] <= 0:
            del self._per_address[counted]
        return connection

    def is_current(self, room_id: str, student_id: str, audio: StudentAudio) -> bool:
        """Whether `audio` is still the student's stream (not replaced by a reconnect)."""
        connection = self.get((room_id, student_id))
        return connection is not None and connection.audio is audio

    def of_room(self, room_id: str) -> list[tuple[tuple[str, str], Connection]]:
        return [(key, c) for key, c in self.items() if key[0] == room_id]

    def from_address(self, room_id: str, address: str, other_than: str) -> int:
        """Students of the room connected from `address`, other than `other_than`."""
        mine = self.get((room_id, other_than))
        return self._per_address[(room_id, address)] - (1 if mine is not None and mine.address == address else 0)

    def per_room(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for room_id, _student in self:
            counts[room_id] = counts.get(room_id, 0) + 1
        return counts
