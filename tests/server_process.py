"""Start a real `streamserver serve` in a subprocess for tests, and talk to it."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

from tests.redis_server import free_port

ADMIN_TOKEN = "test-admin-token"
SECRET = "server-process-test-secret"  # the servers' link secret, unless the environment sets one


class ServerProcess:
    """`program serve ...` (by default this interpreter's streamserver) in `cwd`, with `env`
    (default: this process's) plus the admin token; its output goes to `self.log`."""

    def __init__(self, *extra: str, model: str = "tiny.en", program: Sequence[str] = (sys.executable, "-m", "streamserver"),
                 cwd: Path | None = None, env: Mapping[str, str] | None = None, port: int | None = None) -> None:
        self.port = port or free_port()  # a port of its own: a server started again where it ran
        tls = any(a in ("--tls-self-signed", "--tls-cert") for a in extra)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        environ = dict(os.environ if env is None else env, STREAMSERVER_ADMIN_TOKEN=ADMIN_TOKEN)
        environ.setdefault("STREAMSERVER_SECRET", SECRET)  # required with --redis-url
        self.secret = environ["STREAMSERVER_SECRET"]
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"streamserver-test-{self.port}.log"
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            [*program, "serve", "--port", str(self.port), "--ice-host", "127.0.0.1",
             "--model", model, "--threads", "2", *extra],
            env=environ, cwd=cwd, stdout=self._log_file, stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                # readiness only: the tests that care check the certificate themselves
                with urllib.request.urlopen(self.url + "/healthz", timeout=1, context=ssl._create_unverified_context()) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"server not ready: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log_file.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
