"""A connection closed under a command's write (another task's disconnect() in between: a cluster
client dropping a failed node's connections) raises redis-py's ConnectionError, which every
caller retries, not the AttributeError that redis-py 8.1 lets out (bus/redis_compat.py)."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from streamserver.bus.connect import REDIS_FAILURES, redis_client


def test_a_connection_closed_under_a_write_is_a_connection_error(redis_url):
    async def body() -> None:
        client = redis_client(redis_url, socket_timeout=5)
        try:
            await client.ping()
            connection = await client.connection_pool.get_connection()
            # The write runs in a task of its own (asyncio.wait_for, with a socket timeout): the
            # disconnect of another task lands between the check that the connection is up and
            # the write, as in a cluster's failover.
            write = asyncio.ensure_future(connection.send_packed_command(connection.pack_command("PING")))
            await asyncio.sleep(0)
            connection._writer = None  # what disconnect() leaves: the stream writer gone
            with pytest.raises(RedisConnectionError) as caught:
                await write
            assert isinstance(caught.value, REDIS_FAILURES)
            await client.connection_pool.release(connection)
            assert await client.ping()  # the pool's next connection works
        finally:
            await client.aclose()

    asyncio.run(body())


def test_a_bug_in_a_command_is_not_taken_for_a_connection_error(redis_url):
    async def body() -> None:
        client = redis_client(redis_url, socket_timeout=5)
        try:
            connection = await client.connection_pool.get_connection()
            with pytest.raises(TypeError):
                await connection.send_packed_command(12345)  # not a command: an error of the caller's
            await client.connection_pool.release(connection)
        finally:
            await client.aclose()

    asyncio.run(body())
