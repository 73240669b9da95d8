"""The name a gateway or a worker goes by on the shared bus: its seat leases and capacity beats,
its consumer in the job queue's group."""

from __future__ import annotations

import os
import secrets
import socket


def instance_name() -> str:
    """Unique per start: a container restarted keeps its hostname and PID 1, and a process that
    came back under its old name would be taken for its dead self (a worker's unfinished jobs
    would never be claimed, only timed out)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
