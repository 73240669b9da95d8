"""The two ways to run the server, wired from the same parts:

serve    audio pipeline -> UtteranceSink -> MemoryQueue -> AsrWorker in this process -> bus
gateway  audio pipeline -> UtteranceSink -> RedisQueue (asr:jobs) -> `streamserver worker`
         processes (the same AsrWorker) -> Redis pub/sub; with --fallback-model, what they
         cannot take -> LocalFallback in this process -> the same guard, or its own dashboards
Batching, retries, events and metrics are the same code in both; only the queue differs.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from engines.engine import Engine
from streamserver.api.app import create_app
from streamserver.asr.batch import BatchRecogniser
from streamserver.asr.fallback import LocalFallback
from streamserver.asr.worker import AsrWorker
from streamserver.bus import create_bus
from streamserver.bus.local import LocalFeeds
from streamserver.bus.redis import RedisBus
from streamserver.classroom import Classroom
from streamserver.config import Settings
from streamserver.intent import IntentClassifier
from streamserver.metrics import Metrics
from streamserver.queue.memory_queue import MemoryQueue
from streamserver.queue.redis_queue import RedisQueue
from streamserver.result_log import LoggedPublisher
from streamserver.queue.sink import UtteranceSink
from streamserver.queue.spool import Spool


def serve_app(settings: Settings, engine: Engine, intent: IntentClassifier | None) -> tuple[web.Application, Classroom]:
    """Everything in one process; events through Redis when settings.redis_url is set."""
    bus = create_bus(settings.redis_url, settings.history_len, settings.redis_ca, settings.transcript_retention_s,
                     settings.redis_prefix)
    publisher = LoggedPublisher(bus)  # a line with fields for each result (result_log.py)
    metrics = Metrics()
    queue = MemoryQueue(publisher, bounds=settings.queue_bounds)
    worker = AsrWorker(engine, queue, intent, settings.max_batch, metrics, partials=settings.partials)
    sink = UtteranceSink(queue, publisher, metrics, settings.max_queue_wait_s)
    classroom = Classroom(settings, bus, sink, publisher, metrics, background=(worker,))
    return create_app(classroom, worker), classroom


def gateway_app(settings: Settings, fallback_engine: Engine | None = None,
                intent: IntentClassifier | None = None) -> tuple[web.Application, Classroom]:
    """Recognition in `streamserver worker` processes, found through Redis; with a fallback
    engine, also here for what they cannot take (asr/fallback.py)."""
    if not settings.redis_url:
        raise ValueError("a gateway needs --redis-url: its workers are found through Redis")
    bus = RedisBus(settings.redis_url, settings.history_len, ca_file=settings.redis_ca,
                   transcript_retention_s=settings.transcript_retention_s, prefix=settings.redis_prefix)
    publisher = LoggedPublisher(bus)  # a line with fields for each result (result_log.py)
    queue = RedisQueue(settings.redis_url, history_len=settings.history_len, bounds=settings.queue_bounds,
                       ca_file=settings.redis_ca, transcript_retention_s=settings.transcript_retention_s,
                       prefix=settings.redis_prefix)
    metrics = Metrics()
    spool = Spool(Path(settings.spool_dir)) if settings.spool_dir else None
    local = LocalFeeds()
    fallback = None
    if fallback_engine is not None:
        fallback = LocalFallback(BatchRecogniser(fallback_engine, intent, metrics), queue, local, metrics,
                                 settings.fallback_after_s, spool)
    sink = UtteranceSink(queue, publisher, metrics, settings.max_queue_wait_s, spool, fallback)
    classroom = Classroom(settings, bus, sink, publisher, metrics, background=(fallback,) if fallback else (), local=local)
    if fallback is not None:
        fallback.on_uplink = lambda up: classroom.local.uplink_changed(up, list(classroom.rooms.rooms))
    return create_app(classroom), classroom
