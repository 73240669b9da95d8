"""The garbage collector of a long-running process whose start-up made most of its objects.

CPython's full (generation 2) collection walks every container object alive, those of the
imported libraries (numpy, aiohttp, aiortc, redis, ...), the app and the engine included, while
the event loop stands still. On a gateway with 250 WebSocket students a full collection comes
every few seconds and takes tens of ms (benchmarks/README.md, "4,000 WebSocket students with
captions"): a stall that every student's frames, every ack and
every final waited behind, the loop-lag tail of a loaded gateway. What start-up made lives as
long as the process, so it is moved out of the collector's sight (gc.freeze()): a full collection
then walks only what the process made since (its students' streams: still 10-25 ms at 250), and
comes a tenth as often. Cycles made later are still collected, only later.
"""

from __future__ import annotations

import gc

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
