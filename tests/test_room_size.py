"""A room's per-event and per-join costs do not grow with its size (issue: the lecture hall).

Publishing: a room's events leave in order, through one lane per room (bus/ordered.py); a lane
sends what waits as one batch, so a lecture whose events come faster than one round trip each
costs a round trip per batch, not per event. Joining: a join's per-address check counts from
an index (rooms/connections.py), not over every connection of the process.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from streamserver.bus.ordered import OrderedPublisher
from streamserver.bus.redis import RedisBus
from streamserver.events import StudentEvent
from streamserver.rooms.connections import Connection, Connections


def test_a_rooms_events_leave_in_order_in_few_round_trips(redis_url: str) -> None:
    """2,000 students of one room joining at once: every event published, in the order made,
    in far fewer round trips than events; the same holds room by room for ten rooms."""

    async def body() -> None:
        bus = RedisBus(redis_url, history_len=5000)  # the whole run stays in the history, to check its order
        trips: list[int] = []
        publish_many = bus.publish_many

        async def counted(room_id: str, events: list[tuple[str, bool]]) -> None:
            trips.append(len(events))
            await publish_many(room_id, events)

        bus.publish_many = counted  # type: ignore[method-assign]
        publisher = OrderedPublisher(bus)
        try:
            for rooms in (1, 10):
                trips.clear()
                names = [f"size-{rooms}-{time.time_ns()}-{i}" for i in range(rooms)]
                made = [StudentEvent(names[i % rooms], f"s{i}", f"Student {i}", "student_joined") for i in range(2000)]
                assert all(await asyncio.gather(*(publisher.publish(e) for e in made)))
                assert sum(trips) == len(made)
                assert len(trips) <= len(made) // 20, f"{len(trips)} round trips for {len(made)} events in {rooms} room(s)"
                for name in names:
                    history = [json.loads(e)["student_id"] for e in await bus.history(name, 5000)]
                    assert history == [e.student_id for e in made if e.room_id == name]  # in the order made
        finally:
            await bus.close()

    asyncio.run(body())


def test_a_joins_address_check_costs_the_same_in_a_lecture():
    """The per-address count a join asks for, in a process holding 30 students against 20,000."""

    def timed(students: int) -> float:
        connections = Connections()
        for i in range(students):
            connections[("hall", f"s{i}")] = Connection(_end, None, f"10.0.{i % 200}.{i % 250}")  # type: ignore[arg-type]
        started = time.perf_counter()
        for i in range(2000):
            connections.from_address("hall", f"10.0.{i % 200}.{i % 250}", f"s{i}")
        return time.perf_counter() - started

    small, large = min(timed(30) for _ in range(3)), min(timed(20_000) for _ in range(3))
    assert large < 3 * small + 0.005, f"{large * 1000:.1f} ms against {small * 1000:.1f} ms"


def test_the_address_count_follows_connections_as_they_come_and_go():
    connections = Connections()
    connections[("r", "a")] = Connection(_end, None, "1.1.1.1")  # type: ignore[arg-type]
    connections[("r", "b")] = Connection(_end, None, "1.1.1.1")  # type: ignore[arg-type]
    connections[("q", "c")] = Connection(_end, None, "1.1.1.1")  # type: ignore[arg-type]
    assert connections.from_address("r", "1.1.1.1", "a") == 1  # b: the asking student is not counted
    assert connections.from_address("r", "1.1.1.1", "new") == 2
    connections[("r", "a")] = Connection(_end, None, "2.2.2.2")  # type: ignore[arg-type]  # a reconnect from elsewhere
    assert connections.from_address("r", "1.1.1.1", "new") == 1 and connections.from_address("r", "2.2.2.2", "new") == 1
    del connections[("r", "b")]
    assert connections.pop(("r", "b"), None) is None
    assert connections.from_address("r", "1.1.1.1", "new") == 0 and connections.from_address("q", "1.1.1.1", "new") == 1


async def _end(_reason: str, _code: int) -> None:
    return None


def test_a_room_sets_its_own_size_and_several_dashboards_see_the_same_class():
    """A room asks for its own size (a lecture's thousands; here 4, on a server whose default is
    2): it seats that many and refuses the next; its teacher and two teaching assistants, each on
    a dashboard of their own, see the same events in the same order."""
    import aiohttp

    from streamserver.loadsim.clients import Dashboard, JoinRefused, admin_headers, create_room
    from streamserver.loadsim.ws_student import WsStudent
    from tests.server_process import ADMIN_TOKEN, ServerProcess

    async def scenario(url: str) -> None:
        async with aiohttp.ClientSession() as s:
            for bad in (0, 100_001, "4", 2.5):
                async with s.post(f"{url}/api/rooms", json={"name": "hall", "max_students": bad},
                                  headers=admin_headers(ADMIN_TOKEN)) as r:
                    assert r.status == 400 and "max_students" in (await r.json())["error"]
            room = await create_room(s, url, ADMIN_TOKEN, "hall", max_students=4)
            dashboards = [await Dashboard().open(s, url, room) for _ in range(3)]
            students = [WsStudent(s, url, room, f"student {i}", "") for i in range(4)]
            for student in students:
                await student.connect()
            with pytest.raises(JoinRefused) as refused:
                await WsStudent(s, url, room, "one too many", "").connect()
            assert refused.value.status == 429
            for _ in range(100):
                joined = [[e["student_id"] for e in d.events if e["type"] == "student_joined"] for d in dashboards]
                if all(len(j) == 4 for j in joined):
                    break
                await asyncio.sleep(0.1)
            assert joined[0] == joined[1] == joined[2] and sorted(joined[0]) == sorted(st.student_id for st in students)
            for student in students:
                await student.close()

    with ServerProcess("--max-students", "2") as server:
        asyncio.run(scenario(server.url))


def test_a_feeds_memory_of_what_it_sent_stays_bounded_through_a_long_lecture():
    """A dashboard open for hours: the feed's record of events and results sent keeps the recent
    ones (copies come within seconds of their originals), never the whole class."""
    from streamserver.rooms.feed import Seen
    from streamserver.events import TranscriptEvent, Utterance

    seen = Seen()
    joined = [StudentEvent("hall", f"s{i}", f"Student {i}", "student_joined").to_json() for i in range(3 * Seen.EVENTS_KEPT)]
    assert all(seen.first(e) for e in joined)
    assert not seen.first(joined[-1])  # a recent copy: suppressed
    assert len(seen._events) == Seen.EVENTS_KEPT and len(seen._results) == 0
    import numpy as np

    u = Utterance("utt-1", "hall", "s1", "Ann", "en", np.zeros(160, np.float32), 1.0, 2.0)
    result = TranscriptEvent.of(u, "is the exam open book", "en")
    assert seen.first(result.to_json())
    again = TranscriptEvent.of(u, "is the exam open book?", "en")  # the same utterance, another way
    assert not seen.first(again.to_json())
