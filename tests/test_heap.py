"""streamserver/heap.py: start-up's objects leave the collector's walk; later cycles are still
collected."""

from __future__ import annotations

import gc
import weakref

from streamserver.heap import FULL_EVERY, freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_the_startup_heap_is_frozen_and_later_cycles_are_still_collected():
    threshold = gc.get_threshold()
    try:
        kept = [Node() for _ in range(1000)]  # "start-up": lives as long as the process
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(kept)
        assert gc.get_threshold()[2] == FULL_EVERY
        a, b = Node(), Node()  # a cycle made after start-up, then dropped
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
