"""The teacher feed's WebSocket: the message limit docs/SECURITY.md states, and a close with a code
for a frame that breaks the protocol.

The dashboard sends nothing but its pongs and its close, so the feed reads little; what it reads
must still follow RFC 6455. aiohttp's reader refuses most bad frames (reserved bits or opcodes,
fragments interleaved, a control frame over 125 bytes, a message over the limit) and closes with
their code (1002, 1009), but it takes a client's frame without a mask, which RFC 6455 5.1 says a
server must close on. MaskCheck sits before aiohttp's reader: it reads each frame's header as it
passes and refuses an unmasked one the same way, so that aiohttp's receive() closes with 1002.
"""

from __future__ import annotations

from typing import Any

from aiohttp import WSCloseCode, web
from aiohttp.helpers import set_exception
from aiohttp.http_websocket import WebSocketError

FEED_MESSAGE_LIMIT_BYTES = 1024 * 1024  # the dashboard sends nothing this large
HEARTBEAT_S = 20.0  # a ping this often: a dashboard gone without a close is noticed


class MaskCheck:
    """A parser in front of aiohttp's WebSocket reader that passes the bytes on unchanged until a
    frame comes without a mask: then the reader's queue gets a protocol error (receive() closes
    with 1002) and nothing more is read. The frames' payloads are skipped, not looked at."""

    def __init__(self, reader: Any, queue: Any) -> None:
        self._reader, self._queue = reader, queue
        self._header = bytearray()  # the header of the frame being read, so far
        self._skip = 0  # payload bytes of the current frame still to pass
        self._refused = False

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        if self._refused:  # the close is on its way: what follows the bad frame is not read
            return False, b""
        bad = self._unmasked_at(data)
        if bad is None:
            return self._reader.feed_data(data)
        if bad:
            eof, tail = self._reader.feed_data(data[:bad])  # the frames before it are the client's
            if eof:
                return eof, tail
        self._refused = True
        set_exception(self._queue, WebSocketError(WSCloseCode.PROTOCOL_ERROR, "a client's frame must be masked"))
        return False, b""

    def feed_eof(self) -> None:
        self._reader.feed_eof()

    def _unmasked_at(self, data: bytes) -> int | None:
        """Where in `data` an unmasked frame starts (0 when its header began in earlier data)."""
        at = 0
        while at < len(data):
            if self._skip:
                step = min(self._skip, len(data) - at)
                self._skip -= step
                at += step
                continue
            self._header.append(data[at])
            at += 1
            if len(self._header) < 2:
                continue
            if not self._header[1] & 0x80:
                return max(0, at - len(self._header))
            code = self._header[1] & 0x7F
            extended = 2 if code == 126 else 8 if code == 127 else 0
            if len(self._header) < 2 + extended + 4:  # the length, then the mask key
                continue
            self._skip = int.from_bytes(self._header[2 : 2 + extended], "big") if extended else code
            self._header.clear()
        return None


class FeedSocket(web.WebSocketResponse):
    def _post_start(self, request: web.BaseRequest, protocol: str | None, writer: Any) -> None:
        super()._post_start(request, protocol, writer)
        # aiohttp installs its reader on the connection here: MaskCheck goes in front of it
        request.protocol._payload_parser = MaskCheck(request.protocol._payload_parser, self._reader)


def feed_socket() -> web.WebSocketResponse:
    # aiohttp refuses a message of max_msg_size bytes itself: one more lets the limit through
    return FeedSocket(heartbeat=HEARTBEAT_S, max_msg_size=FEED_MESSAGE_LIMIT_BYTES + 1)
