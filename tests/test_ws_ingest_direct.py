"""The ingest socket's direct path (transport/ws_ingest.py IngestSocket): audio messages taken
inside the socket's read, in the client's order, with the stream's task still handling the rest."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
from aiohttp import web

from streamserver.transport import ws_ingest
from tests.redis_server import free_port


class Taker:
    def __init__(self) -> None:
        self.pieces: list[np.ndarray] = []

    def push_pcm16(self, pcm: np.ndarray) -> None:
        self.pieces.append(pcm.copy())


def test_aiohttp_internals_are_the_ones_the_direct_path_uses() -> None:
    assert ws_ingest._Reader is not None
    for name in ("_post_start", "_on_data_received", "_flush_heartbeat_reset", "_cancel_heartbeat", "_reader", "_parser"):
        assert hasattr(web.WebSocketResponse, name) or name in web.WebSocketResponse.__annotations__, name


async def _run(messages: list[bytes | str]) -> tuple[list[np.ndarray], list, bool, int | None]:
    taker, seen = Taker(), {}

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = ws_ingest.new_socket()
        await ws.prepare(request)
        seen["direct"] = isinstance(ws._reader, ws_ingest._DirectQueue)
        await ws_ingest._stream(ws, {"room_id": "r", "student_id": "s", "resume": ""}, taker, lambda: True, None,
                                ws_ingest.Ender(ws))
        return ws

    app = web.Application()
    app.router.add_get("/ws", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session, session.ws_connect(f"http://127.0.0.1:{port}/ws") as ws:
            got = [(await ws.receive_json())["type"]]
            for m in messages:
                await (ws.send_str(m) if isinstance(m, str) else ws.send_bytes(m))
                await asyncio.sleep(0.005)
            if messages and isinstance(messages[-1], str):
                got.append((await ws.receive_json(timeout=5))["type"])
            await ws.close()
            close = ws.close_code
    finally:
        await runner.cleanup()
    return taker.pieces, got, seen["direct"], close


def test_audio_is_taken_in_order() -> None:
    messages = [np.arange(i * 960, (i + 1) * 960, dtype="<i2").tobytes() for i in range(30)]
    pieces, _, direct, _ = asyncio.run(_run(["{\"format\": \"pcm16\"}", *messages]))
    assert direct
    assert b"".join(p.tobytes() for p in pieces) == b"".join(messages)


def test_bad_audio_taken_directly_closes_the_stream() -> None:
    pieces, got, _, close = asyncio.run(_run([bytes(640), bytes(641), bytes(640)]))
    assert len(pieces) == 1 and close == ws_ingest.CLOSE_BAD_AUDIO


def test_a_format_message_after_audio_is_refused() -> None:
    pieces, got, _, close = asyncio.run(_run([bytes(640), bytes(640), "{\"format\": \"pcm16\"}"]))
    assert got == ["ready", "error"] and len(pieces) == 2
