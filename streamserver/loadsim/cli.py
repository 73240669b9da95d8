"""`streamserver loadsim`: a simulated class against a running server, with a report.

streamserver/cli.py calls add_parser(subparsers) to register the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

from streamserver.loadsim.config import LoadConfig

DESCRIPTION = """Simulate a class against a running server (serve or gateway): create ROOMS rooms
through the room API (admin token from STREAMSERVER_ADMIN_TOKEN), connect STUDENTS students
who take turns speaking real clips, one teacher dashboard per room, and measure end-of-speech ->
dashboard latency, lost and duplicated utterances and join failures. Progress on stderr once a
second; DIR/report.json and PNG plots at the end."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `loadsim` on the `streamserver` command line."""
    p = subparsers.add_parser("loadsim", help="simulate a large class against a running server", description=DESCRIPTION)
    return configure(p)


def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--url", required=True, action="append", metavar="URL",
                   help="the server, e.g. http://127.0.0.1:8080; repeat for several gateways (rooms are spread over them)")
    p.add_argument("--students", type=int, required=True, metavar="N")
    p.add_argument("--duration", type=float, required=True, metavar="S",
                   help="seconds of streaming (then up to --drain seconds waiting for the last transcripts)")
    p.add_argument("--speak-ratio", type=float, default=LoadConfig.speak_ratio, help="share of the students speaking at any moment")
    p.add_argument("--transport", choices=("ws", "webrtc"), default=LoadConfig.transport,
                   help="ws: WebSocket ingest (light); webrtc: every student an aiortc peer")
    p.add_argument("--webrtc-students", type=int, default=LoadConfig.webrtc_students, metavar="K",
                   help="with --transport ws: this many students over WebRTC instead")
    p.add_argument("--webrtc-client", choices=("packets", "encoder"), default=LoadConfig.webrtc_client,
                   help="packets: Opus packets encoded once per clip, shared by every student (light); "
                   "encoder: aiortc's MediaPlayer, encoding for each student (~7x the CPU)")
    p.add_argument("--rooms", type=int, default=LoadConfig.rooms, metavar="R", help="students are spread evenly over R rooms")
    p.add_argument("--language", choices=("en", "zh", "auto"), default=LoadConfig.language,
                   help="the rooms' language (the clips are English)")
    p.add_argument("--frame-ms", type=int, choices=(10, 20, 40, 60, 100), default=LoadConfig.frame_ms, help="WebSocket frame length")
    p.add_argument("--processes", type=int, default=LoadConfig.processes, metavar="P",
                   help="spread the students over P processes (each process is one event loop: one core)")
    p.add_argument("--seed", type=int, default=LoadConfig.seed, help="turn-taking and clip choice")
    p.add_argument("--no-keep-audio", dest="keep_audio", action="store_false", default=LoadConfig.keep_audio,
                   help="WebSocket students keep nothing: a broken stream ends the student (default: like the student page, "
                   "each keeps its audio, reconnects through the next --url and sends again what was not acknowledged)")
    p.add_argument("--drain", type=float, default=LoadConfig.drain_s, metavar="S",
                   help="longest wait for outstanding transcripts at the end (default %(default)g)")
    p.add_argument("--report", type=Path, required=True, metavar="DIR", help="where report.json and the plots go")
    p.set_defaults(handler=main)
    return p


def _check(args: argparse.Namespace) -> str | None:
    if args.students < 1 or args.rooms < 1 or args.rooms > args.students:
        return "need --students >= --rooms >= 1"
    if not 0 < args.speak_ratio <= 1:
        return "--speak-ratio must be in (0, 1]"
    if not 0 <= args.webrtc_students <= args.students:
        return "--webrtc-students must be between 0 and --students"
    if not 0 < args.duration < math.inf:  # nan fails this too
        return "--duration must be a positive number of seconds"
    if not 0 <= args.drain < math.inf:
        return "--drain must be a number of seconds, 0 or more"
    if not 1 <= args.processes <= args.students:
        return "--processes must be between 1 and --students"
    if not os.environ.get("STREAMSERVER_ADMIN_TOKEN"):
        return "set STREAMSERVER_ADMIN_TOKEN to the server's admin token (rooms are created through the API)"
    return None


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def main(args: argparse.Namespace) -> int:
    import aiohttp  # here, not at the top: `streamserver --help` need not load the client stack

    from streamserver.loadsim.run import Run
    from streamserver.transport.udp import DrainingEventLoop

    if (problem := _check(args)) is not None:
        print(f"loadsim: error: {problem}", file=sys.stderr)
        return 2
    config = LoadConfig(
        urls=[u.rstrip("/") for u in args.url], students=args.students, duration_s=args.duration, admin_token=os.environ["STREAMSERVER_ADMIN_TOKEN"],
        speak_ratio=args.speak_ratio, transport=args.transport, webrtc_students=args.webrtc_students, rooms=args.rooms,
        language=args.language, frame_ms=args.frame_ms, seed=args.seed, drain_s=args.drain, processes=args.processes,
        webrtc_client=args.webrtc_client, keep_audio=args.keep_audio,
    )
    try:
        with asyncio.Runner(loop_factory=DrainingEventLoop) as runner:  # UDP read as the server reads it (transport/udp.py)
            result = runner.run(Run(config).run(args.report))
    except (AssertionError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:  # no rooms or no feed: no run
        print(f"loadsim: error: could not set up the class on {', '.join(config.urls)}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    summary = {k: result[k] for k in ("utterances_sent", "transcripts_received", "duplicates", "copies", "recovered", "reconnects", "reconnect_causes", "lost", "lost_vs_queued", "never_queued",
                                      "clips_unsent", "join_failures", "join_retries", "busy_rejections", "never_seated", "disconnects", "ice_consent_expired",
                                      "simulator_max_lag_s", "latency_s", "latency_from_clip_end_s", "partials_received",
                                      "partial_first_s", "partial_first_from_speech_s", "partial_gap_s", "partial_agreement")}
    print(json.dumps(summary), flush=True)
    print(f"loadsim: clips sent {result['utterances_sent']}, transcripts {result['transcripts_received']}, lost {result['lost']}"
          f" (queued without transcript {_or_dash(result['lost_vs_queued'])}, never queued {_or_dash(result['never_queued'])}),"
          f" duplicates {result['duplicates']} (copies of one speech {result['copies']}), recovered {result['recovered']}"
          f" after {result['reconnects']} reconnects {result['reconnect_causes'] or ''}, clips not sent {result['clips_unsent']}, connections lost {result['disconnects']}"
          f" (ICE consent expired on the students' side {result['ice_consent_expired']}), simulator lag {result['simulator_max_lag_s']} s",
          file=sys.stderr, flush=True)
    first = result["partial_first_s"]
    print(f"loadsim: finals p50 {_or_dash(result['latency_s']['p50'])} s, p99 {_or_dash(result['latency_s']['p99'])} s;"
          f" live captions {result['partials_received']}, first p50 {_or_dash(first['p50'])} s from the speech's start on the"
          f" server ({_or_dash(result['partial_first_from_speech_s']['p50'])} s from the student),"
          f" last caption has {_or_dash(result['partial_agreement']['mean'])} of its final's words", file=sys.stderr, flush=True)
    if result["clips_unsent"] or result["simulator_max_lag_s"] > 0.1:
        print("loadsim: warning: the simulator fell behind real time: use --processes, or fewer students per process",
              file=sys.stderr, flush=True)
    print(f"loadsim: report in {args.report}/report.json", file=sys.stderr)
    if result["duplicates"]:  # speech shown twice to a teacher is a failure of the run, not a figure
        print(f"loadsim: error: {result['duplicates']} transcripts reached the dashboards twice "
              f"({result['copies']} of them copies of one speech under another id)", file=sys.stderr, flush=True)
        return 1
    return 0
