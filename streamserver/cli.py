"""The `streamserver` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Sequence

from engines.graphs import DEFAULT_PRECISION, PRECISIONS
from engines.policy import POLICIES

MODELS = ("tiny.en", "base")


def _progress(message: str) -> None:
    print(f"streamserver: {message}", file=sys.stderr, flush=True)


def _transcribe(args: argparse.Namespace) -> int:
    from engines.audio import AudioError, load_audio
    from engines.engine import load_engine
    from engines.weights import WeightsError

    if args.language != "en" and args.model.endswith(".en"):
        _progress(f"error: {args.model} is an English-only model; use --model base for --language {args.language}")
        return 2
    try:
        engine = load_engine(args.model, args.backend, args.threads, args.policy, args.precision, progress=_progress)
        engine.warmup()
    except (WeightsError, ValueError) as error:
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
                "duration_s": round(audio.size / 16000, 3),
                "no_speech_prob": round(max(p.no_speech_prob for p in pieces), 4),
                "rejected": [p.rejected for p in pieces if p.rejected],
            }
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            print(f"{path}: {text}", flush=True)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamserver", description="Real-time voice server for live online classrooms.")
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser("transcribe", help="transcribe audio files (any format PyAV reads)")
    t.add_argument("files", nargs="+", metavar="FILE")
    t.add_argument("--model", choices=MODELS, default="tiny.en")
    t.add_argument("--language", choices=("en", "zh", "auto"), default="en")
    t.add_argument("--backend", choices=("onnxruntime", "auto"), default="onnxruntime")
    t.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1), help="CPU threads for inference")
    t.add_argument("--policy", choices=sorted(POLICIES), help="encoder input length policy (default: measured per model)")
    t.add_argument("--precision", choices=PRECISIONS, default=DEFAULT_PRECISION, help="weight precision of the ONNX graphs")
    t.add_argument("--prompt", help="initial prompt: vocabulary or style to expect (default for zh: a simplified-Chinese sentence)")
    t.add_argument("--json", action="store_true", help="one JSON object per file and line")
    t.set_defaults(handler=_transcribe)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="streamserver: %(message)s")
    return int(args.handler(args))
