"""Liveness beside readiness (issue 32): with its Redis stopped, a gateway still answers /livez
(a liveness probe must not restart it for an outage a restart cannot mend) and answers /readyz
503 (a load balancer sends new students elsewhere); both come back when Redis does. A worker's
/livez answers through the outage too. Real processes around a real redis-server."""

from __future__ import annotations

import json
import time

from tests.redis_server import RedisServer
from tests.server_process import free_port
from tests.test_gateway import Proc, _get, _wait


def _until(url: str, status: int, timeout_s: float) -> tuple[int, str]:
    """The first answer of `url` with `status`, asked every 0.25 s (AssertionError after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    answer = (0, "")
    while time.monotonic() < deadline:
        answer = _get(url)
        if answer[0] == status:
            return answer
        time.sleep(0.25)
    raise AssertionError(f"{url} answered {answer} for {timeout_s} s, never {status}")


def test_with_redis_stopped_a_gateway_is_live_and_not_ready(tmp_path):
    with RedisServer() as redis_server:
        port, worker_port = free_port(), free_port()
        gateway = Proc(tmp_path / "gateway.log", "gateway", "--port", str(port), "--redis-url", redis_server.url)
        worker = Proc(tmp_path / "worker.log", "worker", "--redis-url", redis_server.url, "--threads", "1",
                      "--metrics-port", str(worker_port))
        url, worker_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{worker_port}"
        try:
            _wait(url + "/livez", 60)
            _wait(worker_url + "/livez", 180)
            status, body = _until(url + "/readyz", 200, 180)  # the worker has joined
            assert json.loads(body) == {"ready": True}

            redis_server.stop()
            status, body = _until(url + "/readyz", 503, 15)
            assert "bus unreachable" in json.loads(body)["reason"]
            for _ in range(8):  # over the outage's first seconds, every time
                status, body = _get(url + "/livez")
                assert status == 200 and json.loads(body)["alive"] is True
                assert _get(url + "/readyz")[0] == 503
                assert _get(worker_url + "/livez")[0] == 200
                time.sleep(0.5)
            assert _get(url + "/healthz")[0] == 503  # the old probe: a liveness check on it would restart the gateway

            redis_server.start()
            _until(url + "/readyz", 200, 90)  # ready again once Redis and the worker's registration are back
            assert gateway.proc.poll() is None and worker.proc.poll() is None  # neither process died of the outage
        finally:
            gateway.stop()
            worker.stop()
