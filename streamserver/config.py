"""One settings object for the server, from flags and the environment."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str | None = None
    model: str = "tiny.en"
    backend: str = "onnxruntime"  # or tensorrt, torch-cuda, auto (engines.loading.load_engine)
    threads: int = field(default_factory=lambda: min(4, os.cpu_count() or 1))
    # ICE: aiortc does no trickle ICE and, left alone, asks a public STUN server; both explicit.
    ice_servers: list[dict] = field(default_factory=list)  # [{"urls": [...], "username", "credential"}]
    ice_hosts: list[str] = field(default_factory=list)  # host candidate addresses; empty: all but loopback
    admin_token: str | None = field(default_factory=lambda: os.environ.get("STREAMSERVER_ADMIN_TOKEN"))
    # Signs room tokens; gateways of one deployment share it. Random per process if unset.
    secret: str = field(default_factory=lambda: os.environ.get("STREAMSERVER_SECRET") or secrets.token_hex(32))
    token_ttl_s: int = 12 * 3600
    max_students: int = 500  # per room, across every gateway (seats are leases on the bus)
    seat_lease_s: float = 30.0  # renewed every third of it; a dead gateway's seats free themselves within it
    leave_grace_s: float = 5.0  # a student reconnecting within it keeps the seat with no left/joined pair
    max_body_bytes: int = 64 * 1024  # an SDP offer is a few KB
    max_batch: int = 16
    max_queue_wait_s: float = 5.0  # expected recognition wait past which new students hear "busy"
    history_len: int = 500
    vad_hangover_ms: int = 500  # silence that ends an utterance (audio/segmenter.py); a latency floor
    public_url: str | None = None  # base of the URLs handed out; default http://host:port
