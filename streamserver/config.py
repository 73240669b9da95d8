"""One settings object for the server, from flags and the environment."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field

from streamserver.bus.keys import TRANSCRIPT_RETENTION_S


@dataclass(frozen=True)
class Bounds:
    """How much may wait for recognition: in all, per room and per student. One student or one
    room that floods the queue reaches its own bound and is refused there; everyone else keeps
    their share."""

    total: int = 2000
    per_room: int = 200
    per_student: int = 8


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str | None = None  # redis:// or rediss:// (TLS), an ACL user in it
    redis_ca: str | None = None
    spool_dir: str | None = None  # gateway: utterances the job queue cannot take wait here, on disk
    fallback_model: str | None = None  # gateway: recognise here what the central workers cannot (asr/fallback.py)
    fallback_after_s: float = 3.0  # ... also a queued utterance not published this long after its end
    model: str = "tiny.en"
    backend: str = "onnxruntime"  # or tensorrt, torch-cuda, auto (engines.loading.load_engine)
    threads: int = field(default_factory=lambda: min(4, os.cpu_count() or 1))
    # ICE: aiortc does no trickle ICE and, left alone, asks a public STUN server; both explicit.
    ice_servers: list[dict] = field(default_factory=list)  # [{"urls": [...], "username", "credential"}]
    ice_hosts: list[str] = field(default_factory=list)  # host candidate addresses; empty: all but loopback
    ice_allow: list[str] = field(default_factory=list)  # CIDRs a student's candidates may be on (transport/candidates.py)
    admin_token: str | None = field(default_factory=lambda: os.environ.get("STREAMSERVER_ADMIN_TOKEN"))
    # Signs room tokens; gateways of one deployment share it. Random per process if unset.
    secret: str = field(default_factory=lambda: os.environ.get("STREAMSERVER_SECRET") or secrets.token_hex(32))
    token_ttl_s: int = 12 * 3600  # lifetime of the room links handed out (--link-ttl)
    room_idle_ttl_s: float = 12 * 3600  # a room nobody used this long is gone (--room-idle-expiry)
    max_students: int = 500  # per room, across every gateway (seats are leases on the bus)
    seat_lease_s: float = 30.0  # renewed every third of it; a dead gateway's seats free themselves within it
    leave_grace_s: float = 5.0  # a student reconnecting within it keeps the seat with no left/joined pair
    max_body_bytes: int = 64 * 1024  # an SDP offer is a few KB
    max_batch: int = 16
    max_audio_rate: float = 1.5  # x real time a student's stream may send (audio/pacing.py); more closes it
    queue_bounds: Bounds = field(default_factory=Bounds)  # utterances waiting: in all, per room, per student
    max_queue_wait_s: float = 5.0  # expected recognition wait past which new students hear "busy"
    # share of the time a connected student is expected to speak: admission plans recognition for it
    # (capacity.py), and for more once the students are measured to speak more
    expected_speaking: float = 0.1
    gateway_name: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")
    history_len: int = 500
    transcript_retention_s: int = TRANSCRIPT_RETENTION_S  # a class transcript is kept this long after its last final
    vad_hangover_ms: int = 500  # silence that ends an utterance (audio/segmenter.py); a latency floor
    partials: str = "auto"  # live captions: on, off, auto (while the engine has headroom; asr/worker.py)
    partial_interval_ms: int = 1000  # a live caption per this much new voiced audio
    public_url: str | None = None  # base of the URLs handed out; default http(s)://host:port
    tls_ca_cert: str | None = None  # the self-signed CA (--tls-self-signed), offered at /ca.crt
