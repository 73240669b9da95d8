"""The event loop's UDP reading (transport/udp.py): a loop whose turns are slower than one
student's packet interval falls ever further behind on asyncio's loop (one datagram per socket
per turn: the cause of the WebRTC losses at scale), and keeps up on the draining loop."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from streamserver.transport import udp

PACKET_S = 0.02  # one student's RTP packet interval
TURN_S = 0.03  # a loop turn slower than that (a busy gateway)
SEND_S = 2.0


class Counter(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.seen: list[float] = []  # the send time each datagram carries, in order read
        self.late: list[float] = []  # how long after its sending each was read

    def datagram_received(self, data: bytes, addr) -> None:  # noqa: ANN001
        self.seen.append(float(data.decode()))
        self.late.append(time.monotonic() - self.seen[-1])


async def _one_student_on_a_slow_loop() -> tuple[int, int, float]:
    """Datagrams sent (one per PACKET_S, for SEND_S), read, and the most any was read late."""
    loop = asyncio.get_running_loop()
    transport, counter = await loop.create_datagram_endpoint(Counter, local_addr=("127.0.0.1", 0))
    address = transport.get_extra_info("sockname")
    stop = False

    def slow_turn() -> None:  # every turn of the loop costs TURN_S
        time.sleep(TURN_S)
        if not stop:
            loop.call_soon(slow_turn)

    sent = 0

    def send() -> None:
        nonlocal sent
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            start = time.monotonic()
            while (now := time.monotonic()) < start + SEND_S:
                sock.sendto(repr(now).encode(), address)
                sent += 1
                time.sleep(max(0.0, start + sent * PACKET_S - time.monotonic()))

    loop.call_soon(slow_turn)
    sender = threading.Thread(target=send)
    sender.start()
    while sender.is_alive():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # two more turns, as a busy loop would give it
    stop = True
    transport.close()
    return sent, len(counter.seen), max(counter.late)


def test_the_asyncio_internals_it_relies_on_are_there():
    loop = udp.DrainingEventLoop()
    try:
        for owner, name in udp.ASYNCIO_INTERNALS:
            assert hasattr(owner, name) or (isinstance(loop, owner) and hasattr(loop, name)), (
                f"{owner.__name__}.{name} is gone: transport/udp.py needs a look")
        assert isinstance(loop._selector, udp.TurnTimingSelector)
    finally:
        loop.close()


def test_a_slow_loop_falls_behind_one_datagram_per_turn():
    sent, read, age = asyncio.run(_one_student_on_a_slow_loop())
    # ~SEND_S / TURN_S turns read one datagram each: a third of the packets still waiting, and growing
    assert read <= sent * PACKET_S / TURN_S + 5 < sent - 20
    assert age > 0.5


def test_the_draining_loop_keeps_up_on_the_same_slow_turns():
    with asyncio.Runner(loop_factory=udp.DrainingEventLoop) as runner:
        sent, read, age = runner.run(_one_student_on_a_slow_loop())
    assert read == sent
    assert age < 2 * TURN_S + PACKET_S  # read in the turn after the one it arrived in


def test_use_draining_loop_makes_every_new_loop_drain():
    before = asyncio.get_event_loop_policy()
    try:
        udp.use_draining_loop()
        loop = asyncio.new_event_loop()
        assert isinstance(loop, udp.DrainingEventLoop)
        loop.close()
    finally:
        asyncio.set_event_loop_policy(before)


def test_one_flooded_socket_gives_way_after_max_reads():
    reads = udp.MAX_READS

    async def flood() -> int:
        loop = asyncio.get_running_loop()
        transport, counter = await loop.create_datagram_endpoint(Counter, local_addr=("127.0.0.1", 0))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _ in range(3 * reads):
                sock.sendto(repr(time.monotonic()).encode(), transport.get_extra_info("sockname"))
        time.sleep(2 * udp.LATE_S)  # a long turn: the next one drains
        while not counter.seen:
            await asyncio.sleep(0)  # the turn that reads the first batch
        first = len(counter.seen)
        transport.close()
        return first

    with asyncio.Runner(loop_factory=udp.DrainingEventLoop) as runner:
        assert runner.run(flood()) == reads


class _CountingSelector(udp.TurnTimingSelector):
    def __init__(self, coalesce_s: float) -> None:
        super().__init__(coalesce_s)
        self.wakes = 0

    def select(self, timeout: float | None = None) -> list:
        ready = super().select(timeout)
        self.wakes += bool(ready)
        return ready


def _wakes_for_a_stream(coalesce_s: float) -> tuple[int, int]:
    """A datagram every 0.5 ms for 0.3 s into one socket: (wakes that found I/O, datagrams)."""
    selector = _CountingSelector(coalesce_s)

    async def stream() -> int:
        loop = asyncio.get_running_loop()
        transport, counter = await loop.create_datagram_endpoint(Counter, local_addr=("127.0.0.1", 0))
        address = transport.get_extra_info("sockname")

        def send() -> None:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                start = time.monotonic()
                for k in range(600):
                    sock.sendto(repr(time.monotonic()).encode(), address)
                    time.sleep(max(0.0, start + (k + 1) * 0.0005 - time.monotonic()))

        sender = threading.Thread(target=send)
        sender.start()
        while sender.is_alive():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)
        transport.close()
        return len(counter.seen)

    with asyncio.Runner(loop_factory=lambda: udp.DrainingEventLoop(selector)) as runner:
        received = runner.run(stream())
    return selector.wakes, received


def test_an_idle_loop_wakes_at_most_every_coalesce_s_and_loses_nothing():
    wakes, received = _wakes_for_a_stream(0.005)
    assert received == 600
    assert wakes <= 0.3 / 0.005 * 1.3 + 10  # about one wake per 5 ms, not one per datagram
    eager, received = _wakes_for_a_stream(0.0)
    assert received == 600 and eager > 2 * wakes


def test_coalescing_never_delays_ready_callbacks():
    async def chain() -> float:
        start = time.monotonic()
        for _ in range(200):
            await asyncio.sleep(0)  # a ready callback each turn: the loop must not sleep between them
        return time.monotonic() - start

    with asyncio.Runner(loop_factory=lambda: udp.DrainingEventLoop(udp.TurnTimingSelector(0.005))) as runner:
        assert runner.run(chain()) < 200 * 0.005 / 4
