"""End-of-speech -> published and -> on the dashboard, for a live class on a running server.

Students are real aiortc peers that play the LibriVox clips of tests/data (with silence around
them) into one room; a dashboard client on the teacher feed records when each transcript
arrives. Every timestamp is this machine's clock (server and clients run here), so
`received - end_of_speech_ts` is what a teacher would feel after the student stops talking.

    STREAMSERVER_ADMIN_TOKEN=... streamserver serve --port 8080 &
    STREAMSERVER_ADMIN_TOKEN=... .venv/bin/python -m benchmarks.live_latency --url http://127.0.0.1:8080 --students 1,5,10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.scoring import wer  # noqa: E402
from engines.audio import load_audio  # noqa: E402
from streamserver.loadsim.clients import Dashboard, create_room, join_student, speech_file  # noqa: E402

CLIPS = Path(__file__).resolve().parent.parent / "tests" / "data" / "librivox"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def one_class(url: str, token: str, n: int, folder: Path) -> dict:
    clips = [(p, load_audio(p), p.with_suffix(".txt").read_text().strip()) for p in sorted(CLIPS.glob("*.wav"))]
    async with aiohttp.ClientSession() as s:
        room = await create_room(s, url, token, f"bench-{n}")
        dashboard = await Dashboard().open(s, url, room)
        arrivals: dict[str, float] = {}
        names = [f"s{i:03d}" for i in range(n)]
        peers = []
        for i, name in enumerate(names):
            wav = speech_file(folder / f"{n}-{name}.wav", clips[i % len(clips)][1])
            peers.append(await join_student(s, url, room, name, wav))
        deadline = time.time() + 60 + 2 * n
        while time.time() < deadline:
            for t in dashboard.transcripts():
                arrivals.setdefault(t["utterance_id"], time.time())
            if {t["student_name"] for t in dashboard.transcripts()} >= set(names):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(2)
        for pc in peers:
            await pc.close()
        await dashboard.close()
    transcripts = dashboard.transcripts()
    published = [t["published_ts"] - t["end_of_speech_ts"] for t in transcripts]
    received = [arrivals[t["utterance_id"]] - t["end_of_speech_ts"] for t in transcripts if t["utterance_id"] in arrivals]
    refs = [clips[i % len(clips)][2] for i in range(n)]
    hyps = [" ".join(t["text"] for t in transcripts if t["student_name"] == name) for name in names]
    return {
        "students": n,
        "transcripts": len(transcripts),
        "wer": round(wer(refs, hyps), 4),
        "eos_to_published_s": {"p50": round(percentile(published, 50), 3), "p90": round(percentile(published, 90), 3), "max": round(max(published, default=float("nan")), 3)},
        "eos_to_dashboard_s": {"p50": round(percentile(received, 50), 3), "p90": round(percentile(received, 90), 3)},
    }


async def main_async(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.students:
            row = await one_class(args.url, args.admin_token, n, Path(tmp))
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--students", default="1,5,10", type=lambda v: [int(x) for x in v.split(",")])
    parser.add_argument("--admin-token", default=os.environ.get("STREAMSERVER_ADMIN_TOKEN"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/live-latency.json"))
    args = parser.parse_args()
    if not args.admin_token:
        raise SystemExit("set STREAMSERVER_ADMIN_TOKEN (or --admin-token)")
    rows = asyncio.run(main_async(args))
    print(f"{'students':>8} {'WER':>6} {'eos->published p50/p90':>24} {'eos->dashboard p50/p90':>24}")
    for r in rows:
        p, d = r["eos_to_published_s"], r["eos_to_dashboard_s"]
        print(f"{r['students']:>8} {100 * r['wer']:>5.1f}% {p['p50']:>11.2f} / {p['p90']:<10.2f} {d['p50']:>11.2f} / {d['p90']:<10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"url": args.url, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
