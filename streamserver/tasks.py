"""Tasks that their starter does not wait for, held until they end: the event loop keeps only a
weak reference to a task, and one that nobody holds can be collected before it is done."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Iterator


class Tasks:
    def __init__(self) -> None:
        self._held: set[asyncio.Task] = set()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work)
        self._held.add(task)
        task.add_done_callback(self._held.discard)
        return task

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(list(self._held))

    async def wait(self, timeout: float) -> None:
        """Until those running now are done, or timeout seconds."""
        if self._held:
            await asyncio.wait(list(self._held), timeout=timeout)

    def cancel(self) -> None:
        for task in list(self._held):
            task.cancel()
