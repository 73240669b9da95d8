"""One room keeping a CPU engine busy on its own (a flood on its shared link) leaves the other
rooms their speculative finals (AsrWorker.busiest_room): the gateways stop offering that room's
hints, the others' speculations and finals go before its finals, and a final whose speculation is
ready is published from it. The real tiny.en engine and real speech, through the in-process queue."""

from __future__ import annotations

import asyncio
import time

from streamserver.asr.worker import BUSY_WINDOW_S, AsrWorker
from streamserver.bus.memory import MemoryBus
from streamserver.bus.ordered import OrderedPublisher
from streamserver.events import Utterance, audio_digest, now
from streamserver.queue.base import wanted_hints
from streamserver.queue.memory_queue import MemoryQueue
from tests.test_partials import CheapRowsEngine, SlowEngine


def busy_with(worker: AsrWorker, seconds_by_room: dict[str, float]) -> None:
    """The engine's last BUSY_WINDOW_S, as rows of these rooms taking these seconds."""
    end = time.monotonic()
    total = sum(seconds_by_room.values())
    worker._busy.append((end - total, end, True))
    for room, seconds in seconds_by_room.items():
        worker._room_busy.append((end, room, seconds))


def test_the_hints_wanted_leave_out_a_room_only_when_every_taker_does():
    assert wanted_hints([]) == ("none", frozenset())
    assert wanted_hints([{"hints": "speculative", "hints_except": "A"}]) == ("speculative", frozenset({"A"}))
    # another worker takes room A's hints: they are wanted
    assert wanted_hints([{"hints": "speculative", "hints_except": "A"}, {"hints": "all", "hints_except": ""}]) == ("all", frozenset())
    # a worker that takes none has no say in which rooms' are wanted
    assert wanted_hints([{"hints": "speculative", "hints_except": "A"}, {"hints": "none"}]) == ("speculative", frozenset({"A"}))


def test_only_a_room_that_keeps_a_cpu_busy_alone_is_its_busiest(tiny_engine):
    queue = MemoryQueue(OrderedPublisher(MemoryBus()))
    flooded = AsrWorker(SlowEngine(tiny_engine, 0.0), queue, None)
    busy_with(flooded, {"A": 0.9 * BUSY_WINDOW_S, "B": 0.05 * BUSY_WINDOW_S})
    assert flooded.busiest_room() == "A" and flooded.hints_taken() == "speculative"
    assert flooded.heartbeat_stats()["hints_except"] == "A"
    every = AsrWorker(SlowEngine(tiny_engine, 0.0), queue, None, partials="on")  # takes every hint, busy or not
    busy_with(every, {"A": 0.9 * BUSY_WINDOW_S})
    assert every.heartbeat_stats()["hints"] == "all" and every.heartbeat_stats()["hints_except"] == ""
    full = AsrWorker(SlowEngine(tiny_engine, 0.0), queue, None)  # five rooms, none of them alone
    busy_with(full, {room: 0.19 * BUSY_WINDOW_S for room in "ABCDE"})
    assert full.busiest_room() is None and full.hints_taken() == "none"
    idle = AsrWorker(SlowEngine(tiny_engine, 0.0), queue, None)
    busy_with(idle, {"A": 0.5 * BUSY_WINDOW_S})
    assert idle.busiest_room() is None  # the engine has headroom: hints as always
    gpu = AsrWorker(CheapRowsEngine(tiny_engine), queue, None)  # its speculations ride in the finals' batches
    busy_with(gpu, {"A": 0.9 * BUSY_WINDOW_S})
    assert gpu.busiest_room() is None


def test_another_rooms_speculation_and_final_go_before_the_busy_rooms_final(tiny_engine, librivox):
    (_, flood, _), (_, speech, _) = librivox[1], librivox[4]

    async def body() -> None:
        queue = MemoryQueue(OrderedPublisher(MemoryBus()))
        engine = SlowEngine(tiny_engine, 0.0)
        worker = AsrWorker(engine, queue, None)
        busy_with(worker, {"A": 0.95 * BUSY_WINDOW_S})
        assert worker.busiest_room() == "A"
        await queue.heartbeat({"capacity": 3.0, "hints": worker.hints_taken(), "hints_except": "A"})
        assert await queue.hints_wanted() == ("speculative", frozenset({"A"}))  # the gateways offer none of A's

        backlog = [Utterance(f"a-{i}", "A", f"s-a{i}", f"A{i}", "en", flood, now() - 3, now()) for i in range(2)]
        for u in backlog:
            await queue.submit(u)
        spoken = Utterance("b-1", "B", "s-b", "Bo", "en", speech, now() - 3, now(), digest=audio_digest(speech))
        await queue.offer(Utterance(**{**spoken.__dict__, "kind": "speculative"}))
        worker.buffer = await queue.read(1, 100)
        assert [u.room_id for _, u in worker.buffer] == ["A"]

        batch = await worker._in_turn("A", 1)
        assert [(u.utterance_id, u.kind) for _, u in batch] == [("b-1", "speculative")]
        assert [u.room_id for _, u in worker.buffer] == ["A"]  # A's final waits its turn
        await worker._speculate(batch)
        assert engine.recognised == 1
        again = await worker._in_turn("A", 1)  # the speculation is not taken twice: A's final's turn
        assert [u.utterance_id for _, u in again] == ["a-0"] and worker.buffer == []

        await queue.submit(spoken)  # B's final, as its hangover ends
        worker.buffer += await queue.read(1, 0)  # the loop's look for another room's final
        batch = await worker._in_turn("A", 1)
        assert [(u.utterance_id, u.kind) for _, u in batch] == [("b-1", "final")]
        await worker._transcribe(batch)
        assert engine.recognised == 1  # published from its speculation: no second recognition
        assert await queue.done_of(["b-1"]) == {"b-1"}
        worker.buffer += await queue.read(1, 0)
        batch = await worker._in_turn("A", 1)  # then A's backlog, in its order
        assert [u.utterance_id for _, u in batch] == ["a-1"]

    asyncio.run(body())
