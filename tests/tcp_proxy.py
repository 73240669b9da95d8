"""A TCP proxy in front of a server (the central Redis), that a test can cut like a failed
uplink: while cut, every byte either way is swallowed (no reset: the far side simply stops
answering, as over a dead internet link) and new connections are accepted and never served;
restore() ends the connections that lived through the cut, as a real link's would time out."""

from __future__ import annotations

import asyncio
import threading

from tests.redis_server import free_port


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.cut_now = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> "TcpProxy":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._client, "127.0.0.1", self.port), self._loop).result(10)
        return self

    def url(self, scheme: str = "redis") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def cut(self) -> None:
        self.cut_now = True

    def restore(self) -> None:
        def close_all() -> None:
            for writer in list(self._writers):
                writer.close()
            self.cut_now = False

        self._loop.call_soon_threadsafe(close_all)

    def stop(self) -> None:
        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.close()

        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        asyncio.run_coroutine_threadsafe(cancel_rest(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while self.cut_now:  # accepted, never served
                await asyncio.sleep(0.1)
                if writer.is_closing():
                    return
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            self._writers.add(up_writer)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        except OSError:
            pass
        finally:
            for w in (writer, locals().get("up_writer")):
                if w is not None:
                    self._writers.discard(w)
                    w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if not self.cut_now:  # during the cut: swallowed
                    writer.write(data)
                    await writer.drain()
        finally:
            writer.close()
