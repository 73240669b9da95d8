"""`streamserver gateway`: the classroom server without an engine. Students' audio is cut into
utterances here as in `serve`, then queued on Redis for `streamserver worker` processes; rooms'
events come back through Redis pub/sub. Any number of gateways and workers share one Redis."""

from __future__ import annotations

from aiohttp import web

from streamserver.api.app import create_app
from streamserver.bus.redis import RedisBus
from streamserver.classroom import Classroom
from streamserver.config import Settings
from streamserver.queue.redis_queue import JobQueue
from streamserver.queue.sink import QueueSink


def gateway_app(settings: Settings, max_queue_wait_s: float) -> tuple[web.Application, Classroom]:
    if not settings.redis_url:
        raise ValueError("a gateway needs --redis-url: its workers are found through Redis")
    bus = RedisBus(settings.redis_url, settings.history_len)
    sink = QueueSink(JobQueue(settings.redis_url, history_len=settings.history_len), bus, max_queue_wait_s)
    classroom = Classroom(settings, None, bus, sink=sink)
    return create_app(classroom), classroom
