"""The real `serve` app in this process (streamserver.server.serve_app on an aiohttp TestServer),
for tests that send it many small hostile requests: no subprocess to start per test.

The app runs on an event loop of its own in a background thread, so that it keeps serving (its
ASR worker, heartbeats, seat renewals) between a test's calls; `run` hands a coroutine to that
loop and waits for it. The HTTP and WebSocket clients run on the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Any, Coroutine, Iterator, TypeVar

import aiohttp
from aiohttp.test_utils import TestServer

from streamserver.config import Settings
from streamserver.rooms import tokens
from streamserver.server import serve_app

SECRET = "live-app-test-secret"  # known to the tests: they sign tokens of their own
ADMIN_TOKEN = "live-app-admin-token"
T = TypeVar("T")


class LiveApp:
    def __init__(self, engine: Any, **settings: Any) -> None:
        self.settings = Settings(secret=SECRET, admin_token=ADMIN_TOKEN, ice_hosts=["127.0.0.1"], **settings)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="live-app", daemon=True)
        self._thread.start()
        self.app, self.classroom = serve_app(self.settings, engine, None)
        self.server = TestServer(self.app, host="127.0.0.1")
        self.run(self.server.start_server())
        self.url = str(self.server.make_url("")).rstrip("/")
        self.ws_url = self.url.replace("http", "ws", 1)
        self.session: aiohttp.ClientSession = self.run(self._session())

    @staticmethod
    async def _session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.session.close())
        self.run(self.server.close())  # the app's cleanup: Classroom.stop()
        self.run(self._cancel_the_rest())  # e.g. the leave grace of the last students, peers' tasks
        self.run(self.loop.shutdown_asyncgens())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    @staticmethod
    async def _cancel_the_rest() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def create_room(self, name: str = "class") -> dict:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with self.session.post(f"{self.url}/api/rooms", json={"name": name}, headers=headers) as r:
            assert r.status == 201, await r.text()
            return await r.json()

    def token(self, room: dict, role: str = "student", ttl_s: float = 600) -> str:
        return tokens.issue(SECRET, room["room_id"], role, ttl_s)

    async def raw_http(self, request: bytes, timeout: float = 10) -> tuple[int, bytes]:
        """One request written byte for byte (headers no client library would send): the
        status and the rest of the answer."""
        reader, writer = await asyncio.open_connection(self.server.host, self.server.port)
        try:
            writer.write(request)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(1 << 16), timeout)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        status_line = answer.split(b"\r\n", 1)[0].split()
        assert len(status_line) >= 2 and status_line[0].startswith(b"HTTP/1."), answer[:200]
        return int(status_line[1]), answer


@contextlib.contextmanager
def live_app(engine: Any, **settings: Any) -> Iterator[LiveApp]:
    app = LiveApp(engine, **settings)
    try:
        yield app
    finally:
        app.close()


async def ws_outcome(ws: aiohttp.ClientWebSocketResponse, timeout: float = 10) -> tuple[list[dict], int | None]:
    """Reads until the server closes (the JSON messages it sent and its close code) or nothing
    more comes within `timeout` (then the code is None: the stream is still open)."""
    messages: list[dict] = []
    while True:
        try:
            message = await ws.receive(timeout)
        except asyncio.TimeoutError:
            return messages, None
        if message.type == aiohttp.WSMsgType.TEXT:
            messages.append(json.loads(message.data))
        elif message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
            return messages, ws.close_code
        elif message.type == aiohttp.WSMsgType.ERROR:
            return messages, ws.close_code
