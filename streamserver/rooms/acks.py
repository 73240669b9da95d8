"""Acks: every client that keeps its audio is told, every ACK_EVERY_S, how far its audio is
safe (audio/pipeline.py StudentAudio.ack; the WebRTC page on its recovery channel,
transport/recovery.py; the WebSocket client on its socket). The acks are the clients' heartbeat,
so they keep their beat whatever else is slow: a round never waits for the queue (what it learns
of published utterances is read beside it, and the next round's acks carry it) nor for the
previous round's sends, and the rounds keep to the clock rather than adding each round's own
time to the period."""

from __future__ import annotations

import asyncio
import logging

from streamserver.events import now
from streamserver.queue.sink import UtteranceSink
from streamserver.rooms.connections import Connection, Connections
from streamserver.transport.recovery import ACK_EVERY_S

log = logging.getLogger(__name__)
ACKS_LATE_S = 1.5  # a round of acks later than this after the last is logged (clients give up at 2 s)


class Acks:
    def __init__(self, connections: Connections, sink: UtteranceSink) -> None:
        self.connections, self.sink = connections, sink
        self._rounds: set[asyncio.Task] = set()  # sends under way (a task needs a reference)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        settling: asyncio.Task | None = None
        tick = last = loop.time()
        while True:
            tick = max(tick + ACK_EVERY_S, loop.time())
            await asyncio.sleep(tick - loop.time())
            if loop.time() - last > ACKS_LATE_S:  # the clients' heartbeat was late: say so, it may cost reconnects
                log.warning("acks went out %.2f s after the last round (%d connections)", loop.time() - last, len(self.connections))
            last = loop.time()
            kept = [c for c in self.connections.values() if c.tell is not None and c.audio.kept]
            if settling is None or settling.done():
                settling = loop.create_task(self._settle(kept))
            ts = now()
            sends = []
            for c in kept:
                if c.audio.closed or not self.connections.is_current(c.audio.room_id, c.audio.student_id, c.audio):
                    continue  # replaced meanwhile: its speech in progress may be the page's to send again
                assert c.tell is not None
                ack = c.audio.ack()
                sends.append(asyncio.ensure_future(c.tell({"type": "ack", "t": None if ack is None else round(ack, 4), "ts": ts})))
            task = loop.create_task(_sent_together(sends, ACK_EVERY_S))
            self._rounds.add(task)
            task.add_done_callback(self._rounds.discard)

    async def _settle(self, kept: list[Connection]) -> None:
        """Learn which of the clients' utterances are published: their audio is safe."""
        try:
            done = await self.sink.settled([uid for c in kept for uid in c.audio.unsettled()])
        except Exception as error:  # noqa: BLE001 - the queue is away or slow: acks stand still, pages keep their audio
            log.debug("acks not advanced: %s", error)
            return
        for c in kept:
            c.audio.settle(done)


async def _sent_together(sends: list[asyncio.Future], timeout_s: float) -> None:
    """Acks go out side by side: one client that reads slowly (its socket's buffer full, a send
    waiting for it to drain) must not hold up the acks of everyone behind it, which would make
    every page of the gateway take the server for gone and reconnect at once. A send still
    waiting after timeout_s is given up; that client gets the next round's."""
    if not sends:
        return
    done, waiting = await asyncio.wait(sends, timeout=timeout_s)
    for send in waiting:
        send.cancel()
    for send in done:
        if not send.cancelled() and send.exception() is not None:  # a client gone this instant: its stream ends anyway
            log.debug("an ack was not sent: %s", send.exception())
