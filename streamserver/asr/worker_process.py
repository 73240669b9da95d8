"""`streamserver worker`: one engine serving every room's utterances from the Redis job queue,
with /metrics, /healthz, /livez and /readyz on a small HTTP port for Prometheus and orchestrators."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from engines.engine import Engine
from streamserver.api.probes import add_livez
from streamserver.asr.worker import AsrWorker
from streamserver.intent import IntentClassifier
from streamserver.bus.connect import redacted
from streamserver.config import Settings
from streamserver.heap import freeze_startup_heap
from streamserver.instance import instance_name
from streamserver.metrics import CONTENT_TYPE
from streamserver.queue.redis_queue import RedisQueue

log = logging.getLogger(__name__)


def metrics_app(worker: AsrWorker) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=worker.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "model": worker.engine.model, "buffer": len(worker.buffer)})

    async def readyz(request: web.Request) -> web.Response:
        return web.json_response({"ready": worker.ready}, status=200 if worker.ready else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    add_livez(app)
    app.router.add_get("/readyz", readyz)
    return app


async def run_worker(
    engine: Engine, intent: IntentClassifier | None, redis_url: str, max_batch: int, name: str | None,
    metrics_host: str, metrics_port: int | None, redis_ca: str | None = None, transcript_retention_s: int | None = None,
    partials: str = Settings.partials, redis_prefix: str = Settings.redis_prefix,
) -> None:
    extra = {"transcript_retention_s": transcript_retention_s} if transcript_retention_s is not None else {}
    queue = RedisQueue(redis_url, name or instance_name(), ca_file=redis_ca, prefix=redis_prefix, **extra)
    worker = AsrWorker(engine, queue, intent, max_batch, partials=partials)
    worker.log_results = True  # it publishes through Redis itself: no publisher of ours logs them
    runner = None
    if metrics_port is not None:
        runner = web.AppRunner(metrics_app(worker), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, metrics_host, metrics_port).start()
    log.info("worker %s taking jobs from %s (metrics on %s)", queue.worker, redacted(redis_url),
             f"http://{metrics_host}:{metrics_port}/metrics" if metrics_port is not None else "no port")
    freeze_startup_heap()  # the engine and the clients are made: full collections walk only what comes later
    try:
        await worker.run()
    finally:
        if runner:
            await runner.cleanup()
        await queue.close()


def main(engine: Engine, intent: IntentClassifier | None, redis_url: str, max_batch: int, name: str | None,
         metrics_host: str, metrics_port: int | None, redis_ca: str | None = None,
         transcript_retention_s: int | None = None, partials: str = Settings.partials,
         redis_prefix: str = Settings.redis_prefix) -> None:
    try:
        asyncio.run(run_worker(engine, intent, redis_url, max_batch, name, metrics_host, metrics_port, redis_ca,
                               transcript_retention_s, partials, redis_prefix))
    except KeyboardInterrupt:
        pass
