"""A live class on `streamserver serve` (the `make run` defaults: tiny.en, in-process worker):
simulated WebSocket students speaking the load simulator's clips, the finals' latency, the live
captions' figures (loadsim's partial_* fields) and the finals' WER against what was said.

    .venv/bin/python -m benchmarks.live_class --students 30 --duration 60 --speak-ratio 0.1 \\
        --label after --out benchmarks/results/live-class.json [--server-args "--partials off"] \\
        [--server-tree DIR]

--server-tree runs the server from another checkout (`git worktree add DIR <commit>`), the
simulator from this one: before and after, measured the same way. WER is pooled over the clips
whose student's clips and transcripts pair up one to one (loadsim's transcripts.json), with
benchmarks/scoring.py's normalisation. Each run is appended to the --out JSON list.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.scoring import wer  # noqa: E402
from tests.server_process import ADMIN_TOKEN, ServerProcess  # noqa: E402

FIGURES = ("utterances_sent", "transcripts_received", "lost", "duplicates", "latency_s", "partials_received",
           "partials_after_final", "partial_first_s", "partial_first_from_speech_s", "partial_gap_s", "partial_agreement", "busy_rejections",
           "simulator_max_lag_s")


def one_run(args: argparse.Namespace, report_dir: Path) -> dict:
    tree = args.server_tree.resolve() if args.server_tree else None
    program = (str(tree / ".venv/bin/python") if tree and (tree / ".venv/bin/python").exists() else sys.executable,
               "-m", "streamserver")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=tree or Path.cwd()).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "streamserver", "engines"], capture_output=True, text=True,
                      cwd=tree or Path.cwd()).stdout.strip():
        commit += "+uncommitted"
    server = ServerProcess(*shlex.split(args.server_args), program=program, cwd=tree)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "streamserver.loadsim", "--url", server.url, "--students", str(args.students),
             "--rooms", str(args.rooms), "--duration", str(args.duration), "--speak-ratio", str(args.speak_ratio),
             "--transport", "ws", "--seed", str(args.seed), "--report", str(report_dir)],
            env=dict(os.environ, STREAMSERVER_ADMIN_TOKEN=ADMIN_TOKEN), capture_output=True, text=True,
            timeout=args.duration + 300,
        )
    finally:
        server.stop()
    if run.returncode != 0:
        raise RuntimeError(f"loadsim failed: {run.stderr[-3000:]}")
    report = json.loads((report_dir / "report.json").read_text())
    pairs = json.loads((report_dir / "transcripts.json").read_text())
    return {
        "label": args.label, "server_commit": commit, "server_args": args.server_args, "students": args.students,
        "rooms": args.rooms, "duration_s": args.duration, "speak_ratio": args.speak_ratio, "seed": args.seed,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        **{k: report.get(k) for k in FIGURES},
        "wer": round(wer([p["reference"] for p in pairs], [p["transcript"] for p in pairs]), 4) if pairs else None,
        "wer_clips": len(pairs),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--students", type=int, default=30)
    p.add_argument("--rooms", type=int, default=1)
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--speak-ratio", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1, help="the simulator's seed: the same turns in every run")
    p.add_argument("--server-args", default="", help="more arguments for `streamserver serve`, one shell-quoted string")
    p.add_argument("--server-tree", type=Path, metavar="DIR", help="run the server from this checkout")
    p.add_argument("--label", default="", help="what is measured")
    p.add_argument("--report", type=Path, help="keep the simulator's report and plots here (default: a temporary folder)")
    p.add_argument("--out", type=Path, required=True, help="JSON list the run is appended to")
    args = p.parse_args()

    report_dir = args.report or Path(tempfile.mkdtemp(prefix="live-class-"))
    row = one_run(args, report_dir)
    print(json.dumps(row), flush=True)
    runs = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([*runs, row], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
