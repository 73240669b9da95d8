"""What a recognition queue offers its two sides: the sink that fills it and the worker that
empties it. MemoryQueue and RedisQueue implement it; AsrWorker and UtteranceSink use only this."""

from __future__ import annotations

from typing import Any, Protocol

from redis.exceptions import RedisError

from streamserver.config import Bounds
from streamserver.events import TranscriptEvent, Utterance

Entry = tuple[str, Utterance]  # (entry id in the queue, the utterance)
# A queue that cannot be reached (Redis away, a socket error): callers retry with backoff.
UNREACHABLE = (RedisError, OSError)
__all__ = ["Bounds", "Entry", "MAX_ATTEMPTS", "QueueFull", "UNREACHABLE", "UtteranceQueue"]
MAX_ATTEMPTS = 3  # a job whose recognition failed this often is given up, with an event


class QueueFull(Exception):
    """An utterance the queue refuses: `scope` ("student", "room" or "total") is the bound reached."""

    def __init__(self, scope: str, limit: int) -> None:
        super().__init__(f"{limit} utterances of this {scope} already wait for recognition" if scope != "total"
                         else f"{limit} utterances already wait for recognition")
        self.scope = scope


class UtteranceQueue(Protocol):
    # Whether a read takes jobs by per-room fair share from everything waiting (a room's next
    # utterance then waits only behind its turn), or in arrival order.
    fair: bool

    # ---- the sink's side ----
    async def submit(self, u: Utterance) -> str:
        """Queue an utterance; its entry id. QueueFull past a bound; UNREACHABLE errors on a queue
        that cannot be reached."""

    async def depth(self) -> int:
        """Jobs not yet published: waiting plus being recognised."""

    async def capacity(self) -> tuple[int, float]:
        """Live workers and their summed recent throughput (utterances/s)."""

    async def backlog(self) -> dict[str, int]:
        """Jobs not yet published, per room (rooms with none are absent)."""

    # ---- the worker's side ----
    async def ensure_group(self) -> None:
        """Ready the queue for reading (after a restart of its store too)."""

    async def read(self, count: int, block_ms: int) -> list[Entry]:
        """Up to `count` new jobs for this worker, waiting up to block_ms for the first."""

    async def claim_orphans(self) -> list[Entry]:
        """Jobs delivered to a worker that died, or idle past the visibility timeout, now ours."""

    async def heartbeat(self, stats: dict[str, Any]) -> None:
        """This worker is alive; stats (utt_per_s) feed capacity()."""

    async def complete(self, entry_id: str, u: Utterance, event: TranscriptEvent) -> bool:
        """Publish the result to the room and acknowledge the job, atomically; False when an
        earlier delivery of the same utterance already published it (nothing is sent again)."""

    async def attempt(self, entry_id: str) -> int:
        """Count a failed recognition of a job; how many there have been."""

    async def close(self) -> None: ...
