"""One way to open a Redis client from a URL, for the bus and the job queue alike.

`redis://[user:password@]host:port/db` or, over the internet uplink of an on-prem gateway,
`rediss://` (TLS): the server's certificate is verified against the system's CAs, or against
`ca_file` (`--redis-ca`, for a deployment's own CA). Redis ACL users come in the URL.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, RedisError, ResponseError

MAX_CONNECTIONS = 2048


def redacted(url: str) -> str:
    """The URL fit for a log line: its password replaced."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redis_client(url: str, ca_file: str | None = None, **options: Any) -> aioredis.Redis:
    # redis-py's asyncio pool allows 100 connections and then raises "Too many connections": a
    # gateway with hundreds of students has more publishes and seat calls in flight than that
    # when a class ends at once (250 students a gateway).
    options.setdefault("max_connections", MAX_CONNECTIONS)
    if ca_file:
        if not url.startswith("rediss://"):
            raise ValueError("--redis-ca is for a TLS Redis: its URL starts with rediss://")
        options["ssl_ca_certs"] = ca_file
    return aioredis.Redis.from_url(url, **options)


async def check_credentials(url: str, ca_file: str | None = None) -> str | None:
    """Why this process cannot use the Redis at `url` at all (a wrong password or user, a
    certificate that does not verify), or None. A Redis that is merely down is not a reason:
    gateways and workers wait for it."""
    client = redis_client(url, ca_file, socket_connect_timeout=5, socket_timeout=5)
    try:
        await client.ping()
    except AuthenticationError as error:
        return f"Redis refused the credentials in the URL: {error}"
    except ResponseError as error:  # NOAUTH, NOPERM ...
        return f"Redis refused this client: {error}"
    except (RedisError, OSError) as error:
        if "certificate" in str(error).lower() or "ssl" in type(error).__name__.lower():
            return f"TLS to Redis failed: {error}"
        return None
    finally:
        await client.aclose()
    return None
