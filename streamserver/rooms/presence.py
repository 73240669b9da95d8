"""Who one dashboard was told is in the room, kept true when a gateway goes quiet.

A gateway that dies publishes no `student_left` for its students: their seats' leases run out
on the bus and nothing more is said. A gateway cut off from the bus for longer than a lease
comes back and renews its students' seats, and says nothing either. A dashboard's feed
(rooms/feed.py) looks at the room's seats now and then and gives each look to Presence, which
answers with what the dashboard must still be told:

- `student_left` for a student it was told is here whose seat is gone two looks in a row, without
  their own `student_left`. Two looks, because a gateway releases a seat just before it
  publishes the student's own `student_left`, which then comes between the two;
- `student_joined` for a student it announced as left whose seat is back without their own
  `student_joined` (their gateway renewed it after an outage).

A student who joins while a look is on its way to the bus is not taken for missing by it: the
look may have been read before their seat was taken.

A look first counts the live seats, which costs the bus the same in a room of 30 as in one of
100,000, and reads who is seated only when that count has moved against the students the
dashboard was told are here since the last look that read them, when a student was missing at
the look before, or at least every FULL_LOOK_EVERY looks (needs_seats).
"""

from __future__ import annotations

JOINED, LEFT = "student_joined", "student_left"
FULL_LOOK_EVERY = 6  # looks: who is seated is read at least this often, whatever the count says


class Presence:
    def __init__(self) -> None:
        self.present: dict[str, str] = {}  # told in the room: student -> name
        self._missing: set[str] = set()  # not seated at the last look: announced if not at the next either
        self._gone: dict[str, str] = {}  # announced as left by a look, not by the room itself
        self._joined_meanwhile: set[str] = set()  # joined since the current look started
        self._counted_only = 0  # looks in a row that did not read who is seated
        # Live seats less students told here, at the last look that read the seats: a difference
        # that lasts (a join whose event the room never published) is not a change.
        self._offset: int | None = None

    def told(self, roster: list[dict]) -> None:
        """The roster the dashboard got: everyone in it is here."""
        self.present = {s["student_id"]: s["student_name"] or "" for s in roster}

    def noted(self, kind: str, student_id: str, name: str) -> None:
        """A `student_joined` or `student_left` of the room that the dashboard got."""
        self._missing.discard(student_id)
        self._gone.pop(student_id, None)
        if kind == JOINED:
            self.present[student_id] = name
            self._joined_meanwhile.add(student_id)
        else:
            self.present.pop(student_id, None)

    def look_starts(self) -> None:
        self._joined_meanwhile.clear()

    def needs_seats(self, live_seats: int) -> bool:
        """Whether this look must read who is seated, given how many seats are live. A count that
        differs from the students the dashboard was told are here by what it did at the last
        look that read the seats, with nobody missing then, says nothing is amiss: a quiet
        gateway's students make it short, a seat renewed after an outage long. The rare pair of
        opposite changes that leaves it even (one of each at once) is found by the next look that
        reads the seats anyway."""
        if (self._offset is not None and live_seats - len(self.present) == self._offset and not self._missing
                and self._counted_only < FULL_LOOK_EVERY - 1):
            self._counted_only += 1
            return False
        self._counted_only = 0
        return True

    def looked(self, seated: set[str], here: set[str]) -> list[tuple[str, str, str]]:
        """What the dashboard must be told after a look at the seats (the students seated on the
        bus; `here`: this process's own students, seated whether the bus lists them or not), as
        (kind, student, name)."""
        now_missing = {s for s in self.present if s not in seated and s not in here} - self._joined_meanwhile
        told = []
        for student_id in now_missing & self._missing:
            name = self.present.pop(student_id)
            self._gone[student_id] = name
            told.append((LEFT, student_id, name))
        for student_id in [s for s in self._gone if s in seated]:
            name = self._gone.pop(student_id)
            self.present[student_id] = name
            told.append((JOINED, student_id, name))
        self._missing = now_missing - self._missing
        self._offset = len(seated) - len(self.present)
        return told
