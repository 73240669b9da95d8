"""The heap of a long-running process: its garbage collector, and the memory it gives back.

The garbage collector of a process whose start-up made most of its objects:
CPython's full (generation 2) collection walks every container object alive, those of the
imported libraries (numpy, aiohttp, aiortc, redis, ...), the app and the engine included, while
the event loop stands still. On a gateway with 250 WebSocket students a full collection comes
every few seconds and takes tens of ms (benchmarks/README.md, "4,000 WebSocket students with
captions"): a stall that every student's frames, every ack and
every final waited behind, the loop-lag tail of a loaded gateway. What start-up made lives as
long as the process, so it is moved out of the collector's sight (gc.freeze()): a full collection
then walks only what the process made since (its students' streams: still 10-25 ms at 250), and
comes a tenth as often. Cycles made later are still collected, only later.

The memory given back: glibc keeps what the process freed in its arenas for later allocations
(the engine's threads each have arenas of their own) and returns little of it by itself. After a
flood of streams ends, the streams' buffers and the backlog's audio are free but stay resident
(benchmarks/README.md, "100 parallel paced streams of one link"). So when the load falls (fewer
streams, a shorter queue), malloc_trim gives the free pages back, off the event loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import time
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

# Second-generation collections between two full ones (CPython's default is 10): about one full
# collection a minute instead of every few seconds on a loaded gateway.
FULL_EVERY = 100


def freeze_startup_heap() -> None:
    """Call once start-up is done (modules imported, app, engine and clients made): collects
    start-up's garbage, then exempts everything left from later collections."""
    gc.collect()
    gc.freeze()
    young, middle, _full = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_EVERY)


TRIM_CHECK_S = 2.0  # how often the load is looked at


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


async def give_back_freed_memory(load: Callable[[], Awaitable[int]]) -> None:
    """Run for the process's life: whenever `load` (streams and queued utterances) fell since the
    last look, hand the heap's free pages back to the system."""
    trim = _malloc_trim()
    if trim is None:
        return
    last = await load()
    while True:
        await asyncio.sleep(TRIM_CHECK_S)
        now = await load()
        if now < last:
            started = time.perf_counter()
            await asyncio.to_thread(trim, 0)
            log.debug("heap trimmed in %.1f ms (load %d, was %d)", 1000 * (time.perf_counter() - started), now, last)
        last = now
