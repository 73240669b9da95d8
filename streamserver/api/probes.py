"""Liveness beside readiness, as orchestrators use them.

/livez answers while the process serves HTTP, whatever its dependencies: a liveness probe that
failed on a Redis outage would restart every gateway and worker at once, and a restart does not
bring Redis back. /readyz (api/app.py for `serve` and `gateway`, asr/worker_process.py for a
worker) is the one that depends on the bus and the workers: a load balancer stops sending new
students to a process that is not ready, and nothing restarts it.
"""

from __future__ import annotations

import os

from aiohttp import web

LIVEZ = "/livez"


async def livez(request: web.Request) -> web.Response:
    """200 with the process's id: the event loop runs and the HTTP side answers."""
    return web.json_response({"alive": True, "pid": os.getpid()})


def add_livez(app: web.Application) -> None:
    app.router.add_get(LIVEZ, livez)
