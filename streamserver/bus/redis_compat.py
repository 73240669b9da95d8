"""A connection closed under a command is a connection error, whichever redis-py says.

redis-py's asyncio connection writes through `asyncio.wait_for` when it has a socket timeout (ours
always do), and on Python 3.11 that runs the write in a task of its own: a `disconnect()` from
another task in between (a cluster client dropping the connections of a node that failed over, a
pool closing an idle connection the server reset) leaves the write an `AttributeError`
("'NoneType' object has no attribute 'writelines'") or, on newer Pythons, a `TypeError` from the
closed transport, not a `ConnectionError` (redis/redis-py#4287). Neither is retried by redis-py
nor taken by our callers for Redis being away, so a worker died of a primary's failover. Here such
an error, raised while the connection is closed, becomes the `ConnectionError` it is; any other
stays what it is."""

from __future__ import annotations

from typing import Any

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError

_send_packed_command = AbstractConnection.send_packed_command


def _closed_under_it(error: Exception) -> bool:
    """The write met the stream or transport that a disconnect emptied: redis-py disconnects on
    any error before it raises, so the connection's state afterwards says nothing; what was
    missing does."""
    return "'NoneType' object" in str(error)


async def _send_or_connection_error(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
    try:
        await _send_packed_command(self, command, check_health)
    except (AttributeError, TypeError) as error:
        if not _closed_under_it(error):
            raise  # not a closed connection: a bug, raised as it is
        await self.disconnect(nowait=True)
        raise RedisConnectionError(f"the connection closed while a command was written ({error})") from error


def install() -> None:
    """Once per process, before the first client is made (bus/connect.py imports it)."""
    if AbstractConnection.send_packed_command is not _send_or_connection_error:
        AbstractConnection.send_packed_command = _send_or_connection_error  # type: ignore[method-assign]
