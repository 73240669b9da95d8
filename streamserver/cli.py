"""The `streamserver` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import astuple
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from engines.backends import DEFAULT_BACKEND, ENGINES, BackendUnavailable
from engines.features import SAMPLE_RATE
from engines.graphs import DEFAULT_PRECISION, PRECISIONS
from engines.policy import POLICIES
from engines.tensorrt import builder as tensorrt_builder
from engines.tensorrt.profiles import ProfileSettings
from engines.weights import DEFAULT_MODEL
from engines.weights import MODELS as PACKAGED_MODELS
from streamserver import __version__, processes
from streamserver.audio.segmenter import HANGOVER_MS_RANGE, SegmenterConfig
from streamserver.bus.keys import TRANSCRIPT_RETENTION_S
from streamserver.cli_env import configure_logging, defaults_from_env
from streamserver.config import GPU_MAX_BATCH, PARTIAL_MODES, THREADS_MAX, Bounds, Settings, default_threads
from streamserver.loadsim import cli as loadsim_cli

MODELS = tuple(PACKAGED_MODELS)
# The defaults the command line itself owns; every other one is read from where it is defined
# (config.Settings, the segmenter, the engines), so that it is written once (tests/test_defaults.py).
METRICS_HOST = "127.0.0.1"  # an internal address: /metrics there needs no admin token
FALLBACK_THREADS_MAX = 2  # a gateway's CPU also serves its students' audio
PARTIAL_INTERVAL_MS_RANGE = (250, 10_000)
DAY_S = 86400


REDIS_PREFIX_HELP = ("put before every Redis key, so that deployments can share one Redis (the same on every gateway and "
                     "worker of a deployment; default: none)")

def _progress(message: str) -> None:
    print(f"streamserver: {message}", file=sys.stderr, flush=True)


def _transcribe(args: argparse.Namespace) -> int:
    from engines.audio import AudioError, load_audio
    from engines.loading import load_engine
    from engines.weights import WeightsError

    if args.language != "en" and args.model.endswith(".en"):
        _progress(f"error: {args.model} is an English-only model; use --model base for --language {args.language}")
        return 2
    try:
        engine = load_engine(args.model, args.backend, _threads(args.threads), args.policy, args.precision, progress=_progress)
        engine.warmup()
    except (WeightsError, BackendUnavailable, ValueError) as error:
        _progress(f"error: {error}")
        return 2
    failed = 0
    for path in args.files:
        start = time.perf_counter()
        try:
            audio = load_audio(path)
        except AudioError as error:
            _progress(f"error: {error}")
            failed += 1
            continue
        pieces = engine.transcribe_long(audio, args.language, args.prompt)
        latency_ms = (time.perf_counter() - start) * 1000
        text = " ".join(p.text for p in pieces if p.text).strip()
        language = (pieces[0].language if pieces else None) or None  # unknown: no voiced audio to detect it on
        if args.json:
            record = {
                "file": path,
                "text": text,
                "language": language,
                "latency_ms": round(latency_ms, 1),
                "duration_s": round(audio.size / SAMPLE_RATE, 3),
                "no_speech_prob": round(max(p.no_speech_prob for p in pieces), 4),
                "rejected": [p.rejected for p in pieces if p.rejected],
            }
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            print(f"{path}: {text}", flush=True)
    return 1 if failed else 0


def _warm_engine_and_intent(model: str, backend: str, threads: int):  # noqa: ANN202 - lazy imports
    """The speech engine and the intent classifier, loaded and warmed up so that the first
    student's words pay for neither; None (with the reason on stderr) when the engine cannot load."""
    from engines.loading import load_engine
    from engines.weights import WeightsError
    from streamserver.intent.model import EmbeddingIntentClassifier, intent_embedder_for

    try:
        engine = load_engine(model, backend, threads, progress=_progress)
        engine.warmup()
        intent = EmbeddingIntentClassifier(embedder=intent_embedder_for(getattr(engine, "backend_name", "")))
    except (WeightsError, BackendUnavailable, ValueError) as error:
        _progress(f"error: {error}")
        return None
    intent.classify(["warm up"])  # the worker's calibration warms every batch size, in its own thread
    return engine, intent


Number = TypeVar("Number", int, float)


def _bounded(convert: Callable[[str], Number], low: float, high: float, what: str, unit: str = "",
             above: bool = False, span: str = "") -> Callable[[str], Number]:
    """An argparse type: `convert` of the text, from low (or above it, with `above`) to high; a
    usage error names `what` a value must be, or the range (`span`: the range in words)."""
    units = f" {unit}" if unit else ""
    shown = span or f"{low:g}..{high:g}{units}" + (f" (exclusive of {low:g})" if above else "")

    def parse(text: str) -> Number:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not (low < value if above else low <= value) or not value <= high:  # nan is neither
            raise argparse.ArgumentTypeError(f"{value:g}{units} is outside {shown}")
        return value

    return parse


_share = _bounded(float, 0, 1, "a number", above=True)
# Numbers a server cannot use (a port past 65535, no students, a negative wait) are usage errors
# at start, not a traceback at bind or a server that turns everyone away.
_port = _bounded(int, 1, 65535, "a port number")
_count = _bounded(int, 1, 10**9, "a whole number", span="1 or more")
_count_or_0 = _bounded(int, 0, 10**9, "a whole number", span="0 or more")
_seconds_or_0 = _bounded(float, 0, 1e9, "a number of seconds", "s", span="0 or more seconds")
_seconds = _bounded(float, 0, 1e9, "a number of seconds", "s", above=True, span="more than 0 seconds")
_times_real_time = _bounded(float, 1, 1000, "a number", span="1 (real time) or more")
_positive_seconds = _bounded(float, 0, 3600, "a number of seconds", "s", above=True)
_hangover_ms = _bounded(int, *HANGOVER_MS_RANGE, "a whole number of milliseconds", "ms")
_partial_interval_ms = _bounded(int, *PARTIAL_INTERVAL_MS_RANGE, "a whole number of milliseconds", "ms")
_retention_days = _bounded(float, 1 / 24, 3650, "a number of days", "days", span="1 hour .. 10 years")


def _processes(text: str) -> int:
    try:
        return processes.processes_arg(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count of at least 1 or auto, got {text!r}") from None


def _threads(given: int | None, most: int = THREADS_MAX) -> int:
    """--threads (or --fallback-threads) as given, else the machine's: its cores, at most `most`."""
    return default_threads(most) if given is None else given


def _add_vad_options(p: argparse.ArgumentParser) -> None:
    low, high = HANGOVER_MS_RANGE
    p.add_argument("--vad-hangover-ms", type=_hangover_ms, default=SegmenterConfig.hangover_ms, metavar="MS",
                   help=f"silence that ends an utterance ({low}..{high}; default %(default)s); every latency includes it")


def _add_partial_options(p: argparse.ArgumentParser, interval: bool = True) -> None:
    p.add_argument("--partials", choices=PARTIAL_MODES, default=Settings.partials,
                   help="live captions while a student speaks: auto (while the engine has headroom), on, off "
                        "(default %(default)s)")
    if interval:
        low, high = PARTIAL_INTERVAL_MS_RANGE
        p.add_argument("--partial-interval-ms", type=_partial_interval_ms, default=Settings.partial_interval_ms, metavar="MS",
                       help=f"a live caption per this much new voiced audio ({low}..{high}; default %(default)s)")


def _add_retention_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transcript-retention-days", type=_retention_days, default=TRANSCRIPT_RETENTION_S / DAY_S,
                   metavar="DAYS",
                   help="how long a class's transcript (every final, for the teacher's export) is kept after its last "
                        "one (default %(default)g): in Redis, or in the memory of a `serve` without Redis (gone when it "
                        "stops)")


def _add_server_options(p: argparse.ArgumentParser, gateway: bool) -> None:
    """The options `serve` and `gateway` share: the network side, rooms, limits, the audio path."""
    _add_retention_option(p)
    p.add_argument("--host", default=Settings.host, help="the address to listen on (default %(default)s)")
    p.add_argument("--port", type=_port, default=Settings.port, help="the port, HTTP or HTTPS (default %(default)s)")
    if gateway:
        p.add_argument("--redis-url", required=True, help="the Redis that gateways and workers share: redis:// or rediss:// "
                       "(TLS), redis+cluster://HOST:PORT[,HOST:PORT...] (a Redis Cluster), or "
                       "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER (Sentinels; docs/redis.md)")
    else:
        p.add_argument("--redis-url", help="route events through Redis pub/sub (default: embedded in-process bus)")
    p.add_argument("--ice-host", action="append", metavar="ADDR",
                   help="host candidate address (repeatable; 127.0.0.1 also allows students' loopback candidates)")
    p.add_argument("--ice-server", action="append", metavar="URL",
                   help="STUN/TURN server URL for the students' browsers (repeatable; none by default), e.g. "
                        "turn:host:3478?transport=udp")
    p.add_argument("--ice-username", metavar="U", help="the TURN servers' username")
    p.add_argument("--ice-credential", metavar="C", help="the TURN servers' credential")
    p.add_argument("--ice-servers-file", metavar="FILE", type=Path,
                   help='ICE servers as JSON: [{"urls": [...], "username": ..., "credential": ...}], as RTCPeerConnection takes them')
    p.add_argument("--ice-allow", action="append", metavar="CIDR", type=_network,
                   help="networks students' ICE candidates may be on (repeatable; default: any routable address, "
                        "no loopback or link-local)")
    p.add_argument("--turn-url", action="append", metavar="URL",
                   help="TURN server URL (repeatable) handed out with a credential minted per request that expires after "
                        "--turn-ttl, from the secret it shares with coturn's --static-auth-secret "
                        "(STREAMSERVER_TURN_SECRET or STREAMSERVER_TURN_SECRET_FILE)")
    p.add_argument("--turn-ttl", type=_seconds, default=Settings.turn_ttl_s, metavar="S",
                   help="lifetime of a minted TURN credential (default %(default)s)")
    p.add_argument("--max-students", type=_count, default=Settings.max_students,
                   help="per room, the whole room across gateways (seat leases; default %(default)s)")
    p.add_argument("--idle-seat", type=_seconds_or_0, default=Settings.idle_seat_s, metavar="S",
                   help="end a student's stream that brings no audio this long, and free its seat (0: never; "
                        "default %(default)s)")
    p.add_argument("--offers-per-minute", type=_count_or_0, default=Settings.offers_per_minute, metavar="N",
                   help="WebRTC offers a minute from one client address, and with one link (0: no limit; default "
                        "%(default)s)")
    p.add_argument("--public-url", help="base URL put in the links handed out (default http://HOST:PORT)")
    p.add_argument("--link-ttl", type=_seconds, default=Settings.token_ttl_s, metavar="S",
                   help="lifetime of the room links handed out (default %(default)s)")
    p.add_argument("--room-idle-expiry", type=_seconds, default=Settings.room_idle_ttl_s, metavar="S",
                   help="a room nobody used this long is gone (default %(default)s)")
    p.add_argument("--max-queue-wait", type=_seconds, default=Settings.max_queue_wait_s, metavar="S",
                   help="answer new students 'busy' (503) when the expected transcription wait passes this (default %(default)s)")
    p.add_argument("--expected-speaking", type=_share, default=Settings.expected_speaking, metavar="SHARE",
                   help="share of the time a student is expected to speak: new students are answered 'busy' "
                        "when the workers could not keep up with every connected student speaking that much, or "
                        "the more they are measured to speak (default %(default)s)")
    p.add_argument("--max-queued", type=_count, nargs=3, default=astuple(Bounds()), metavar=("ALL", "ROOM", "STUDENT"),
                   help="utterances that may wait for recognition in all, per room and per student; past them an "
                        "utterance is dropped with an event and the room answers busy (default %(default)s)")
    p.add_argument("--max-audio-rate", type=_times_real_time, default=Settings.max_audio_rate, metavar="X",
                   help="a student's stream sending faster than X times real time is closed (default %(default)s)")
    p.add_argument("--header-timeout", type=_seconds, default=Settings.header_timeout_s, metavar="S",
                   help="close a connection that has not sent a whole request (or sat idle) this long (default %(default)s)")
    p.add_argument("--metrics-port", type=_port, metavar="PORT",
                   help="also serve /metrics without the admin token on --metrics-host:PORT (an internal address)")
    p.add_argument("--metrics-host", default=METRICS_HOST, help="the address of --metrics-port (default %(default)s)")
    p.add_argument("--redis-ca", metavar="FILE", help="CA certificate of a rediss:// (TLS) Redis (default: the system's CAs)")
    p.add_argument("--redis-prefix", default=Settings.redis_prefix, metavar="PREFIX", help=REDIS_PREFIX_HELP)
    p.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM, chain included; with --tls-key)")
    p.add_argument("--tls-key", metavar="FILE", help="the private key of --tls-cert (PEM)")
    p.add_argument("--tls-self-signed", metavar="DIR", type=Path,
                   help="serve HTTPS with a classroom CA made once in DIR (and reused) and a certificate for this "
                        "machine's names and LAN addresses; the CA is offered at /ca.crt, instructions at /ca")
    _add_vad_options(p)
    _add_partial_options(p)


def _ice_servers(args: argparse.Namespace) -> list[dict]:
    """--ice-server URLs (TURN ones with --ice-username/--ice-credential) and --ice-servers-file."""
    servers: list[dict] = []
    for url in args.ice_server or []:
        server: dict = {"urls": [url]}
        if url.startswith(("turn:", "turns:")) and args.ice_username:
            server.update(username=args.ice_username, credential=args.ice_credential or "")
        servers.append(server)
    if args.ice_servers_file:
        try:
            listed = json.loads(args.ice_servers_file.read_text())
        except (OSError, ValueError) as error:
            raise SystemExit(f"streamserver: error: --ice-servers-file {args.ice_servers_file}: {error}") from None
        if not isinstance(listed, list) or not all(isinstance(s, dict) and s.get("urls") for s in listed):
            raise SystemExit(f"streamserver: error: --ice-servers-file {args.ice_servers_file}: a JSON list of "
                             '{"urls": [...], "username", "credential"} objects')
        servers += [{"urls": s["urls"] if isinstance(s["urls"], list) else [s["urls"]],
                     **{k: s[k] for k in ("username", "credential") if k in s}} for s in listed]
    return servers


def _turn_secret(args: argparse.Namespace) -> str | None:
    """The secret --turn-url's credentials are minted from: from the environment, never a flag."""
    from streamserver.turn import TurnSecretError, secret_from_env

    try:
        secret = secret_from_env()
    except TurnSecretError as error:
        raise SystemExit(f"streamserver: error: {error}") from None
    if args.turn_ttl <= 0:
        raise SystemExit("streamserver: error: --turn-ttl must be a positive number of seconds")
    if args.turn_url and not secret:
        raise SystemExit("streamserver: error: --turn-url needs STREAMSERVER_TURN_SECRET or STREAMSERVER_TURN_SECRET_FILE "
                         "(coturn's --static-auth-secret)")
    return secret


def _network(text: str) -> str:
    import ipaddress

    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _tls(args: argparse.Namespace):  # noqa: ANN202 - lazy import of streamserver.tls
    """The TLS files to serve with, or None; TlsError (ValueError) for flags that do not fit."""
    from streamserver.tls import Tls, TlsError, fingerprint, self_signed

    if args.tls_self_signed and (args.tls_cert or args.tls_key):
        raise TlsError("use --tls-self-signed or --tls-cert/--tls-key, not both")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise TlsError("--tls-cert and --tls-key go together")
    if args.tls_self_signed:
        tls = self_signed(args.tls_self_signed, args.public_url)
        _progress(f"classroom CA {tls.ca_cert} (SHA-256 {fingerprint(tls.ca_cert)}): students' devices trust it once, "
                  "from /ca on this server")
    else:
        tls = Tls(Path(args.tls_cert), Path(args.tls_key)) if args.tls_cert else None
    if tls:
        tls.context()  # fails now, with the files named, rather than at the first connection
    return tls


def _settings(args: argparse.Namespace, **extra: object) -> Settings:
    total, room, student = args.max_queued
    return Settings(
        host=args.host, port=args.port, redis_url=args.redis_url, ice_hosts=args.ice_host or [],
        ice_servers=_ice_servers(args), ice_allow=args.ice_allow or [],
        turn_urls=args.turn_url or [], turn_secret=_turn_secret(args), turn_ttl_s=int(args.turn_ttl),
        max_students=args.max_students, public_url=args.public_url, vad_hangover_ms=args.vad_hangover_ms,
        max_queue_wait_s=args.max_queue_wait, queue_bounds=Bounds(total, room, student), max_audio_rate=args.max_audio_rate,
        token_ttl_s=int(args.link_ttl), room_idle_ttl_s=args.room_idle_expiry, redis_ca=args.redis_ca,
        redis_prefix=args.redis_prefix,
        transcript_retention_s=int(args.transcript_retention_days * DAY_S), partials=args.partials,
        partial_interval_ms=args.partial_interval_ms, expected_speaking=args.expected_speaking,
        idle_seat_s=args.idle_seat, offers_per_minute=args.offers_per_minute, header_timeout_s=args.header_timeout,
        **extra,
    )


def _redis_check(url: str | None, ca_file: str | None) -> bool:
    """A Redis that refuses our credentials (or whose certificate does not verify) is one clear
    line and exit status 2 at start; one that is only down is waited for, as at any other time."""
    if not url:
        return True
    import asyncio

    from streamserver.bus.connect import check_credentials, redacted

    try:
        reason = asyncio.run(check_credentials(url, ca_file))
    except ValueError as error:  # a URL redis-py cannot read, --redis-ca without rediss://
        reason = str(error)
    if reason:
        _progress(f"error: {redacted(url)}: {reason}")
        return False
    return True


def _secret_check(settings, command: str) -> bool:  # noqa: ANN001 - a Settings
    """Links signed with a random per-process secret break at every restart, and gateways that
    share rooms need one secret: with Redis the secret is required, without it a warning."""
    if os.environ.get("STREAMSERVER_SECRET"):
        return True
    if settings.redis_url:
        _progress(f"error: {command} with Redis needs STREAMSERVER_SECRET (the same on every gateway): the rooms outlive "
                  "this process, and their links must too")
        return False
    _progress("warning: STREAMSERVER_SECRET is not set: room links are signed with a random secret and stop working "
              "when this process restarts")
    return True


def _run_server(app, settings, args: argparse.Namespace, classroom, tls=None) -> None:  # noqa: ANN001 - aiohttp and ours
    import asyncio

    from aiohttp import web

    from streamserver.api.app import metrics_app
    from streamserver.heap import freeze_startup_heap
    from streamserver.logs import set_process_fields
    from streamserver.transport.udp import use_draining_loop

    index = processes.child_index()  # one of `gateway --processes`: its port shared with its siblings
    metrics_port = None if args.metrics_port is None else args.metrics_port + (index or 0)
    if metrics_port is not None:
        async def metrics_site(app: web.Application):  # noqa: ANN202 - an aiohttp cleanup context
            runner = web.AppRunner(metrics_app(classroom.metrics), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, args.metrics_host, metrics_port).start()
            yield
            await runner.cleanup()

        app.cleanup_ctx.append(metrics_site)

    async def settle_heap(app: web.Application) -> None:  # the last start-up step: what it made stays
        freeze_startup_heap()

    app.on_startup.append(settle_heap)
    if index is not None:
        async def watch_parent(app: web.Application):  # noqa: ANN202 - an aiohttp cleanup context
            task = asyncio.get_running_loop().create_task(processes.orphaned())
            yield
            task.cancel()

        app.cleanup_ctx.append(watch_parent)
    set_process_fields(gateway=settings.gateway_name)  # on every JSON log line (streamserver/logs.py)
    use_draining_loop()  # UDP sockets read until empty each turn: a late turn is made up (transport/udp.py)
    web.run_app(app, host=settings.host, port=settings.port, print=None, access_log=None,
                keepalive_timeout=args.header_timeout, ssl_context=tls.context() if tls else None,
                reuse_port=index is not None)


def _serve(args: argparse.Namespace) -> int:
    from streamserver.bus.connect import redacted
    from streamserver.rooms import tokens
    from streamserver.server import serve_app

    try:
        tls = _tls(args)
    except ValueError as error:
        _progress(f"error: {error}")
        return 2
    settings = _settings(args, model=args.model, backend=args.backend, threads=_threads(args.threads),
                         tls_ca_cert=str(tls.ca_cert) if tls and tls.ca_cert else None)
    if not _secret_check(settings, "serve") or not _redis_check(settings.redis_url, settings.redis_ca):
        return 2
    loaded = _warm_engine_and_intent(settings.model, settings.backend, settings.threads)
    if loaded is None:
        return 2
    engine, intent = loaded
    app, classroom = serve_app(settings, engine, intent)
    if args.demo_room:
        language = "en" if not engine.multilingual else "auto"
        room = classroom.rooms.create(args.demo_room, language)  # before the loop runs: this process only
        base = settings.public_url or f"{'https' if tls else 'http'}://{settings.host}:{settings.port}"
        links = tokens.room_links(settings.secret, room.room_id, base, settings.token_ttl_s)
        print(f"demo room {room.name!r} ({language}):", flush=True)
        print(f"  teacher: {links['teacher_url']}")
        print(f"  student: {links['student_url']}", flush=True)
    bus = "redis " + redacted(settings.redis_url) if settings.redis_url else "embedded bus"
    _progress(f"serving on {'https' if tls else 'http'}://{settings.host}:{settings.port} ({settings.model}, {bus})")
    _run_server(app, settings, args, classroom, tls)
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from streamserver.bus.connect import redacted
    from streamserver.server import gateway_app

    try:
        tls = _tls(args)
    except ValueError as error:
        _progress(f"error: {error}")
        return 2
    settings = _settings(args, tls_ca_cert=str(tls.ca_cert) if tls and tls.ca_cert else None, spool_dir=args.spool_dir,
                         fallback_model=args.fallback_model, fallback_after_s=args.fallback_after)
    if not _secret_check(settings, "gateway") or not _redis_check(settings.redis_url, settings.redis_ca):
        return 2
    if args.processes > 1 and processes.child_index() is None:  # the parent only starts and stops them
        _progress(f"gateway: {args.processes} processes on {'https' if tls else 'http'}://{settings.host}:{settings.port}")
        return processes.run_children(args.argv, args.processes)
    fallback = None
    if settings.fallback_model:  # loaded now, so that the first outage pays no start-up
        threads = _threads(args.fallback_threads, FALLBACK_THREADS_MAX)
        fallback = _warm_engine_and_intent(settings.fallback_model, "onnxruntime", threads)
        if fallback is None:
            return 2
    try:
        app, classroom = gateway_app(settings, *(fallback or (None, None)))
    except ValueError as error:
        _progress(f"error: {error}")
        return 2
    local = f"; fallback {settings.fallback_model} after {settings.fallback_after_s:g} s" if fallback else ""
    _progress(f"gateway on {'https' if tls else 'http'}://{settings.host}:{settings.port} "
              f"(jobs and rooms through {redacted(settings.redis_url)}{local})")
    _run_server(app, settings, args, classroom, tls)
    return 0


def _worker(args: argparse.Namespace) -> int:
    # Workers run several to a machine: ONNX Runtime threads that spin while idle take the cores
    # from the others. STREAMSERVER_ORT_SPIN=1 restores the spinning process-wide pool.
    os.environ.setdefault("STREAMSERVER_ORT_SPIN", "0")
    from streamserver.asr import worker_process

    if not _redis_check(args.redis_url, args.redis_ca):
        return 2
    loaded = _warm_engine_and_intent(args.model, args.backend, _threads(args.threads))
    if loaded is None:
        return 2
    engine, intent = loaded
    max_batch = args.max_batch or (GPU_MAX_BATCH if engine.batch_rows_cheap else Settings.max_batch)
    worker_process.main(engine, intent, args.redis_url, max_batch, args.name, args.metrics_host, args.metrics_port,
                        args.redis_ca, int(args.transcript_retention_days * DAY_S), args.partials, args.redis_prefix)
    return 0


def _intent(args: argparse.Namespace) -> int:
    from streamserver.intent.model import EmbeddingIntentClassifier

    texts = args.texts or [line.rstrip("\n") for line in sys.stdin]
    classifier = EmbeddingIntentClassifier()
    for text, intent in zip(texts, classifier.classify(texts)):
        if args.json:
            print(json.dumps({"text": text, **intent.to_dict()}, ensure_ascii=False), flush=True)
        else:
            print(f"{intent.label or '-'}\t{intent.score:.2f}\t{text}", flush=True)
    return 0


def _engine_build(args: argparse.Namespace) -> int:
    from engines.tensorrt.builder import BuildError, build_engines
    from engines.weights import WeightsError

    try:
        files = build_engines(args.model, args.precision, args.calibration_dir, args.max_batch, progress=_progress)
    except (BackendUnavailable, BuildError, WeightsError, ValueError) as error:
        _progress(f"error: {error}")
        return 1
    for path in (*files.plans.values(), files.sidecar):
        print(path, flush=True)
    return 0


BACKEND_HELP = ("auto: tensorrt, else torch-cuda, else onnxruntime (the CPU), warning for each that cannot load "
                "(default %(default)s)")
THREADS_HELP = f"CPU threads for inference (default: the machine's cores, at most {THREADS_MAX})"
MODEL_HELP = (f"a packaged model ({', '.join(MODELS)}; default %(default)s), a CTranslate2 (faster-whisper) Whisper model "
              "folder, or the name of one in $STREAMSERVER_MODEL_DIRS (`streamserver models` lists them)")


def _model(text: str) -> str:
    """--model: a packaged name, or the absolute path of a model folder (engines.weights.resolve_model)."""
    from engines.weights import WeightsError, resolve_model

    try:
        return resolve_model(text)
    except WeightsError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _models(args: argparse.Namespace) -> int:
    from engines.catalog import describe_models

    for line in describe_models(json_lines=args.json):
        print(line, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamserver", description="Real-time voice server for live online classrooms. Every option can also be "
        "given as the environment variable STREAMSERVER_<OPTION> (e.g. STREAMSERVER_REDIS_URL); a flag wins.")
    parser.add_argument("--version", action="version", version=f"streamserver {__version__}")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="the least severe log records written (default %(default)s)")
    parser.add_argument("--log-format", default="text", choices=("text", "json"),
                        help="text lines, or one JSON object a line (ts, level, logger, message, and room_id, student_id, "
                             "utterance_id, gateway where a line is about one); tokens are redacted")
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser("transcribe", help="transcribe audio files (any format PyAV reads)")
    t.add_argument("files", nargs="+", metavar="FILE")
    t.add_argument("--model", type=_model, default=DEFAULT_MODEL, metavar="NAME|DIR", help=MODEL_HELP)
    t.add_argument("--language", choices=("en", "zh", "auto"), default="en", help="the language spoken (default %(default)s)")
    t.add_argument("--backend", choices=(*ENGINES, "auto"), default=DEFAULT_BACKEND, help=BACKEND_HELP)
    t.add_argument("--threads", type=_count, help=THREADS_HELP)
    t.add_argument("--policy", choices=sorted(POLICIES), help="encoder input length policy (default: measured per model)")
    t.add_argument("--precision", choices=PRECISIONS, default=DEFAULT_PRECISION, help="weight precision of the ONNX graphs")
    t.add_argument("--prompt", help="initial prompt: vocabulary or style to expect (default for zh: a simplified-Chinese sentence)")
    t.add_argument("--json", action="store_true", help="one JSON object per file and line")
    t.set_defaults(handler=_transcribe)

    m = commands.add_parser("models", help="the models --model takes: packaged ones and the folders in $STREAMSERVER_MODEL_DIRS")
    m.add_argument("--json", action="store_true", help="one JSON object a line")
    m.set_defaults(handler=_models)
    i = commands.add_parser("intent", help="label utterances: question, help_request, answer, acknowledgement, off_task")
    i.add_argument("texts", nargs="*", metavar="TEXT", help="utterances (default: one per line on stdin)")
    i.add_argument("--json", action="store_true", help="one JSON object per line: text, label, score")
    i.set_defaults(handler=_intent)

    s = commands.add_parser("serve", help="run the classroom server (API, WebRTC, ASR worker, dashboard feed)")
    _add_server_options(s, gateway=False)
    s.add_argument("--model", type=_model, default=Settings.model, metavar="NAME|DIR", help=MODEL_HELP)
    s.add_argument("--backend", choices=(*ENGINES, "auto"), default=Settings.backend, help=BACKEND_HELP)
    s.add_argument("--threads", type=_count, help=THREADS_HELP)
    s.add_argument("--demo-room", metavar="NAME", help="create a room at start and print its teacher and student URLs")
    s.set_defaults(handler=_serve)

    g = commands.add_parser("gateway", help="students' audio and the rooms' API, with ASR in worker processes (needs Redis)")
    _add_server_options(g, gateway=True)
    g.add_argument("--spool-dir", metavar="DIR",
                   help="keep utterances the job queue cannot take (Redis unreachable) on disk here, fsync'd, and queue "
                        "them in order when it returns, also after a restart (default: retry in memory for 120 s)")
    g.add_argument("--fallback-model", type=_model, metavar="NAME|DIR",
                   help="transcribe here, on this machine's CPU, what the central workers cannot: Redis unreachable, no "
                        "worker alive, or an utterance not transcribed --fallback-after seconds after its end; shown on "
                        "this gateway's dashboards and written to the room's history once the uplink is back (default: off)")
    g.add_argument("--fallback-after", type=_positive_seconds, default=Settings.fallback_after_s, metavar="SECONDS",
                   help="how long a queued utterance may wait for a central worker before the fallback takes it "
                        "(default %(default)g)")
    g.add_argument("--fallback-threads", type=_count,
                   help=f"CPU threads of the fallback model (default: the machine's cores, at most {FALLBACK_THREADS_MAX})")
    g.add_argument("--processes", type=_processes, default=1, metavar="N|auto",
                   help="run N gateways from this command, on one port (the kernel deals connections over them) and "
                        "one bus; auto: one per core of this machine (default %(default)s)")
    g.set_defaults(handler=_gateway)

    w = commands.add_parser("worker", help="an ASR worker: transcribes queued utterances of every room (needs Redis)")
    w.add_argument("--redis-url", required=True, help="redis://[user:password@]host:port, or rediss:// for TLS; "
                   "redis+cluster://HOST:PORT[,...] or redis+sentinel://HOST:PORT[,...]/MASTER (docs/redis.md)")
    w.add_argument("--redis-ca", metavar="FILE", help="CA certificate of a rediss:// (TLS) Redis (default: the system's CAs)")
    w.add_argument("--redis-prefix", default=Settings.redis_prefix, metavar="PREFIX", help=REDIS_PREFIX_HELP)
    w.add_argument("--model", type=_model, default=Settings.model, metavar="NAME|DIR", help=MODEL_HELP)
    w.add_argument("--backend", choices=(*ENGINES, "auto"), default=Settings.backend, help=BACKEND_HELP)
    w.add_argument("--threads", type=_count, help=THREADS_HELP)
    w.add_argument("--max-batch", type=_count,
                   help=f"the most utterances recognised in one engine call (default {GPU_MAX_BATCH} on a GPU, "
                        f"{Settings.max_batch} on a CPU)")
    _add_retention_option(w)
    _add_partial_options(w, interval=False)
    w.add_argument("--name", help="consumer name in the Redis group (default: HOST-PID-RANDOM, new at every start)")
    w.add_argument("--metrics-host", default=METRICS_HOST, help="the address of --metrics-port (default %(default)s)")
    w.add_argument("--metrics-port", type=_port, help="serve /metrics, /healthz, /readyz here")
    w.set_defaults(handler=_worker)

    loadsim_cli.add_parser(commands)

    e = commands.add_parser("engine", help="prepare GPU inference engines")
    engine_commands = e.add_subparsers(dest="engine_command", required=True)
    b = engine_commands.add_parser("build", help="build (or find cached) TensorRT engines for this GPU; progress on stderr")
    b.add_argument("--backend", choices=("tensorrt",), default="tensorrt", help="the engines' kind (the only one)")
    b.add_argument("--model", type=_model, default=DEFAULT_MODEL, metavar="NAME|DIR", help=MODEL_HELP)
    b.add_argument("--precision", choices=tensorrt_builder.PRECISIONS, default=tensorrt_builder.PRECISION,
                   help="int8 calibrates the encoder on --calibration-dir; TensorRT-RTX builds fp32 only (default %(default)s)")
    b.add_argument("--calibration-dir", type=Path, metavar="DIR", help="representative speech files for int8 calibration")
    b.add_argument("--max-batch", type=_count, default=ProfileSettings.max_batch,
                   help="largest batch the engines accept (default %(default)s)")
    b.set_defaults(handler=_engine_build)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults_from_env(parser, argv=argv)
    args = parser.parse_args(argv)
    args.argv = argv  # `gateway --processes` starts its children with it
    configure_logging(args.log_level, args.log_format)
    return int(args.handler(args))
