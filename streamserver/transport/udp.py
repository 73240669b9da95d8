"""An asyncio event loop whose UDP sockets are read until empty each time they are readable.

asyncio's selector loop reads one datagram per readable socket per loop turn. A WebRTC student
has a socket of their own (aioice), sending 50 RTP packets a second, and STUN consent checks
arrive on the same socket. As long as every loop turn takes under 20 ms that keeps up; after one
longer turn (a burst of DTLS handshakes as a class joins, a GC pause, a slow callback) each
socket is behind by a few packets, and since it is then read only one packet per turn while it
still gets one per 20 ms, it never catches up: the kernel's buffer fills, packets are dropped,
the audio that is read is seconds late, and the consent replies behind it come so late that
the browser's ICE gives up after ~30 s (from 70-100 students a gateway on 2 cores;
tests/test_udp_drain.py reproduces it). Read until the socket is empty
(at most MAX_READS at a time, so that one flooded socket cannot starve the others) after a turn
long enough to leave more than one packet in a socket, a late turn is made up in the next one;
a larger receive buffer (RCVBUF) rides out the late turn itself.

Installed by the server and the load simulator with use_draining_loop(); asyncio has no public
hook for its datagram transport, so this subclasses its selector loop's transport factory and
transport (the names in ASYNCIO_INTERNALS, checked by the test against Python 3.11).
"""

from __future__ import annotations

import asyncio
import logging
import selectors
import socket
import time
from asyncio import selector_events

log = logging.getLogger(__name__)

MAX_READS = 64  # datagrams per socket per loop turn: 1.3 s of one student's packets
LATE_S = 0.010  # a loop turn longer than this may have left more than one packet in a socket
COALESCE_S = 0.002  # the loop wakes at most this often when idle (TurnTimingSelector)
PROBE_EVERY = 8  # wakes of a socket between two looks for a second datagram behind the first
RCVBUF = 1 << 20  # bytes asked for; the kernel caps it at net.core.rmem_max (often 208 KiB)

ASYNCIO_INTERNALS = (
    (selector_events.BaseSelectorEventLoop, "_make_datagram_transport"),
    (selector_events._SelectorDatagramTransport, "_read_ready"),
    (selector_events._SelectorDatagramTransport, "max_size"),
    (asyncio.DefaultEventLoopPolicy, "_loop_factory"),
    (selector_events.BaseSelectorEventLoop, "_selector"),
)


class TurnTimingSelector(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
    """The loop's selector, noting how long the loop worked between two waits (busy_s), and
    waking at most every coalesce_s when it has nothing else to do.

    Each wake costs the loop and the kernel more than a packet's own work (about 40 us per
    packet on asyncio's loop with nothing done per packet, 2 cores here: tests/test_udp_drain.py),
    and students' packets arrive spread over each 20 ms, so nearly every packet would wake the loop
    on its own. Before it waits, the loop first sleeps until coalesce_s after its last wake, so
    that each wake finds the packets of many students (22-24 us per packet at 2-5 ms): at most
    that much later for every event, never when callbacks are ready or a turn ran longer."""

    def __init__(self, coalesce_s: float = 0.0) -> None:
        super().__init__()
        self.busy_s = 0.0
        self.coalesce_s = coalesce_s
        self._woke = time.monotonic()

    def select(self, timeout: float | None = None) -> list:
        entered = time.monotonic()
        self.busy_s = entered - self._woke
        if self.coalesce_s and (timeout is None or timeout > 0):
            wait = self._woke + self.coalesce_s - entered
            if wait > 0:
                if timeout is not None:
                    wait = min(wait, timeout)
                    timeout -= wait
                time.sleep(wait)
        ready = super().select(timeout)
        self._woke = time.monotonic()
        return ready


class DrainingDatagramTransport(selector_events._SelectorDatagramTransport):
    """asyncio's datagram transport, reading up to MAX_READS datagrams per wake when the loop's
    last turn was long enough (LATE_S) for a socket to hold more than one, or the socket was
    found behind; otherwise one, as asyncio does (a second read would mostly find the socket
    empty: a syscall and an exception for every packet)."""

    def __init__(self, loop, sock, protocol, address=None, waiter=None, extra=None) -> None:  # noqa: ANN001 - asyncio's
        super().__init__(loop, sock, protocol, address, waiter, extra)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        except OSError:  # not a socket that takes it: the default buffer
            pass

    _wakes = 0
    _behind = False  # the last drain found more than one datagram waiting

    def _read_ready(self) -> None:
        self._wakes += 1
        late = getattr(self._loop._selector, "busy_s", 1.0) > LATE_S
        # A socket that gets datagrams faster than the loop wakes (more than one per coalesced
        # wake) is found by a probe every PROBE_EVERY wakes, and drained while it stays behind.
        reads = MAX_READS if late or self._behind or self._wakes % PROBE_EVERY == 0 else 1
        got = 0
        self._behind = False
        for _ in range(reads):
            if self._conn_lost:
                return
            try:
                data, addr = self._sock.recvfrom(self.max_size)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._protocol.error_received(exc)
                return
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:  # noqa: BLE001 - as asyncio's own transport
                self._fatal_error(exc, "Fatal read error on datagram transport")
                return
            got += 1
            self._behind = got > 1
            self._protocol.datagram_received(data, addr)


class DrainingEventLoop(asyncio.SelectorEventLoop):
    def __init__(self, selector: selectors.BaseSelector | None = None) -> None:
        super().__init__(selector or TurnTimingSelector(COALESCE_S))

    def _make_datagram_transport(self, sock, protocol, address=None, waiter=None, extra=None):  # noqa: ANN001, ANN202
        return DrainingDatagramTransport(self, sock, protocol, address, waiter, extra)


class DrainingPolicy(asyncio.DefaultEventLoopPolicy):
    _loop_factory = DrainingEventLoop


def use_draining_loop() -> None:
    """Every event loop made from now on in this process (asyncio.run, aiohttp's run_app) is a
    DrainingEventLoop."""
    asyncio.set_event_loop_policy(DrainingPolicy())
