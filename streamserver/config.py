"""One settings object for the server, from flags and the environment.

Each default is written once: here, or in the module that owns it (the segmenter's hangover, the
pacing rate, the packaged model), which Settings reads; the command line's defaults read these
(tests/test_defaults.py checks both).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

from engines.backends import DEFAULT_BACKEND
from engines.weights import DEFAULT_MODEL
from streamserver.audio.pacing import RATE
from streamserver.audio.segmenter import SegmenterConfig
from streamserver.bus.keys import TRANSCRIPT_RETENTION_S
from streamserver.instance import instance_name

# Live captions (asr/worker.py): while the engine has headroom, always, never.
PARTIAL_MODES = ("auto", "on", "off")
# A worker's batch on a GPU, where rows cost little: the GPU engine's largest encoder graph
# (engines/gpu/engine.py ENCODER_BUCKETS), so that a lecture's peak fills few batches.
GPU_MAX_BATCH = 64
THREADS_MAX = 4  # inference threads, unless given: the CPU's cores up to this many


def machine_cores() -> int:
    """The cores this process may run on (a container's CPU set, where it has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads(most: int = THREADS_MAX) -> int:
    """The CPU's cores, at most `most`: what an engine runs on unless told otherwise."""
    return min(most, machine_cores())


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
    redis_prefix: str = ""  # before every Redis key: deployments sharing one Redis (bus/keys.py KeyLayout)
    spool_dir: str | None = None  # gateway: utterances the job queue cannot take wait here, on disk
    fallback_model: str | None = None  # gateway: recognise here what the central workers cannot (asr/fallback.py)
    fallback_after_s: float = 3.0  # ... also a queued utterance not published this long after its end
    model: str = DEFAULT_MODEL
    backend: str = DEFAULT_BACKEND  # or tensorrt, torch-cuda, auto (engines.loading.load_engine)
    threads: int = field(default_factory=default_threads)
    # ICE: aiortc does no trickle ICE and, left alone, asks a public STUN server; both explicit.
    ice_servers: list[dict] = field(default_factory=list)  # [{"urls": [...], "username", "credential"}]
    ice_hosts: list[str] = field(default_factory=list)  # host candidate addresses; empty: every interface and 127.0.0.1
    ice_allow: list[str] = field(default_factory=list)  # CIDRs a student's candidates may be on (transport/candidates.py)
    # TURN with short-lived credentials (turn.py): minted per /api/config answer from the secret it shares with coturn
    turn_urls: list[str] = field(default_factory=list)
    turn_secret: str | None = None  # from STREAMSERVER_TURN_SECRET(_FILE), never a flag
    turn_ttl_s: int = 3600  # a minted credential's lifetime (--turn-ttl)
    admin_token: str | None = field(default_factory=lambda: os.environ.get("STREAMSERVER_ADMIN_TOKEN"))
    # Signs room tokens; gateways of one deployment share it. Random per process if unset.
    secret: str = field(default_factory=lambda: os.environ.get("STREAMSERVER_SECRET") or secrets.token_hex(32))
    token_ttl_s: int = 12 * 3600  # lifetime of the room links handed out (--link-ttl)
    room_idle_ttl_s: float = 12 * 3600  # a room nobody used this long is gone (--room-idle-expiry)
    max_students: int = 500  # per room, across every gateway (seats are leases on the bus)
    seat_lease_s: float = 30.0  # renewed every third of it; a dead gateway's seats free themselves within it
    leave_grace_s: float = 5.0  # a student reconnecting within it keeps the seat with no left/joined pair
    idle_seat_s: float = 60.0  # a stream that brings no audio this long is ended and its seat freed (rooms/idle.py); 0: never
    offers_per_minute: int = 300  # WebRTC offers a minute per client address and per link (rooms/offers.py); 0: no limit
    max_body_bytes: int = 64 * 1024  # an SDP offer is a few KB
    header_timeout_s: float = 10.0  # a request's head, and its body, must arrive within this (--header-timeout)
    max_batch: int = 16  # on a CPU, where each row costs about what it costs alone (GPU_MAX_BATCH on a GPU)
    max_audio_rate: float = RATE  # x real time a student's stream may send (audio/pacing.py); more closes it
    queue_bounds: Bounds = field(default_factory=Bounds)  # utterances waiting: in all, per room, per student
    max_queue_wait_s: float = 5.0  # expected recognition wait past which new students hear "busy"
    # share of the time a connected student is expected to speak: admission plans recognition for it
    # (capacity.py), and for more once the students are measured to speak more
    expected_speaking: float = 0.1
    gateway_name: str = field(default_factory=instance_name)
    history_len: int = 500
    transcript_retention_s: int = TRANSCRIPT_RETENTION_S  # a class transcript is kept this long after its last final
    vad_hangover_ms: int = SegmenterConfig.hangover_ms  # silence that ends an utterance (audio/segmenter.py); a latency floor
    partials: str = "auto"  # live captions, one of PARTIAL_MODES
    partial_interval_ms: int = 1000  # a live caption per this much new voiced audio
    public_url: str | None = None  # base of the URLs handed out; default http(s)://host:port
    tls_ca_cert: str | None = None  # the self-signed CA (--tls-self-signed), offered at /ca.crt
