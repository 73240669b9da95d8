"""The load simulator's output: DIR/report.json and five PNG plots.

matplotlib (the `loadsim` extra) is imported only here, with the Agg backend: no display needed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from streamserver.loadsim.measure import Tally

PLOTS = ("latency_cdf.png", "latency_over_time.png", "active_speakers.png", "queue_depth.png", "captions_cdf.png")


def build(settings: dict[str, Any], tally: Tally, timeline: list[dict], metrics_seen: bool) -> dict[str, Any]:
    return {
        **settings,
        "utterances_sent": tally.utterances_sent,
        "utterances_queued": len(tally.queued) if tally.queued else None,
        "transcripts_received": len(tally.transcripts),
        "duplicates": tally.duplicates,
        "copies": tally.copies,  # of them: one student's speech transcribed twice under two ids (measure.py)
        "recovered": tally.recovered,  # transcripts of speech a student sent again after a break
        "reconnects": tally.reconnects,
        "reconnect_causes": dict(tally.reconnect_causes),  # why students broke off: closed, no_ack, send_failed
        "lost": tally.lost(),  # clips sent with no transcript, per student (measure.py)
        "lost_vs_queued": tally.lost_vs_queued(),  # utterances the gateway announced with no transcript
        "never_queued": tally.never_queued(),  # clips sent the gateway never announced as utterances
        "clips_unsent": tally.clips_unsent,  # clips the simulator did not finish sending (> 0: it fell behind)
        "join_failures": tally.join_failures,
        "join_retries": tally.join_retries,  # joins with no answer (a reset, a timeout), tried again
        "busy_rejections": tally.busy_rejections,  # busy answers to joins, retries included
        "never_seated": tally.never_seated,  # students told busy on every try until the class ended
        "disconnects": tally.disconnects,
        # of them, closed by the students' own ICE: the server answered no consent check for ~30 s
        "ice_consent_expired": tally.ice_consent_expired,
        "latency_s": tally.latency_stats(),  # from the server's end_of_speech_ts
        "latency_from_clip_end_s": tally.latency_stats(tally.latencies_from_clip_end()),  # from the student's clock (measure.py)
        "latency_parts": tally.latency_parts(),  # where the finals' latency went (measure.py)
        **tally.partial_stats(),  # live captions (measure.py)
        "max_students_connected": max((row["connected"] for row in timeline), default=0),
        "max_active_speakers": max((row["active_speakers"] for row in timeline), default=0),
        "simulator_max_lag_s": round(tally.max_lag_s, 3),  # > 0.1: the simulator itself was overloaded
        "metrics_available": metrics_seen,
        "errors": dict(tally.errors),
        "timeline": timeline,
    }


def write(folder: Path, report: dict[str, Any], tally: Tally) -> list[Path]:
    """report.json and the plots; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "report.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    pairs = folder / "transcripts.json"  # what each clip said and its transcript, for scoring
    pairs.write_text(json.dumps([{"reference": r, "transcript": t} for r, t in tally.transcript_pairs()], ensure_ascii=False) + "\n")
    return [out, pairs, *_plots(folder, report, tally)]


def _plots(folder: Path, report: dict[str, Any], tally: Tally) -> list[Path]:
    try:
        import matplotlib
    except ImportError:  # the numbers are in report.json already; only the pictures are missing
        print("loadsim: no plots: matplotlib is not installed (pip install 'streamserver[loadsim]')", file=sys.stderr)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = report["timeline"]
    t = [row["t"] for row in timeline]
    lat = tally.latencies()
    title = f"students {report['students']}, rooms {report['rooms']}, {report['transport']}, speak ratio {report['speak_ratio']}"
    files = []

    def save(fig, name: str) -> None:
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        files.append(folder / name)

    fig, ax = plt.subplots(figsize=(6, 4))
    if lat.size:
        ax.step(np.sort(lat), np.arange(1, lat.size + 1) / lat.size, where="post")
        for q, style in ((50, ":"), (99, "--")):
            ax.axvline(np.percentile(lat, q), color="grey", linestyle=style, label=f"p{q} {np.percentile(lat, q):.2f} s")
        ax.legend(loc="lower right")
    ax.set(xlabel="end of speech -> dashboard (s)", ylabel="fraction of transcripts", title="latency CDF", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    save(fig, "latency_cdf.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    points = sorted(tally.transcripts.values())
    ax.scatter([p[0] for p in points], [p[1] for p in points], s=6, alpha=0.6)
    ax.set(xlabel="time since start (s)", ylabel="end of speech -> dashboard (s)", title="latency over time")
    ax.grid(alpha=0.3)
    save(fig, "latency_over_time.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(t, [row["active_speakers"] for row in timeline], label="speaking")
    ax.plot(t, [row["connected"] * report["speak_ratio"] for row in timeline], linestyle="--", label="connected x speak ratio")
    ax.set(xlabel="time since start (s)", ylabel="students", title="active speakers")
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, "active_speakers.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(t, [row["queue_depth"] for row in timeline])
    note = "" if report["metrics_available"] else " (no streamserver_queue_depth on /metrics: 0)"
    ax.set(xlabel="time since start (s)", ylabel="utterances", title="queue depth" + note)
    ax.grid(alpha=0.3)
    save(fig, "queue_depth.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    series = (("final: end of speech -> dashboard", lat), ("first live caption: speech start -> dashboard",
              np.asarray(tally.partial_first_seconds())), ("between live captions", np.asarray(tally.partial_gaps)))
    for label, values in series:
        if values.size:
            ax.step(np.sort(values), np.arange(1, values.size + 1) / values.size, where="post",
                    label=f"{label} (p50 {np.percentile(values, 50):.2f} s)")
    if any(values.size for _, values in series):
        ax.legend(loc="lower right", fontsize=7)
    ax.set(xlabel="seconds", ylabel="fraction", title="finals and live captions", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    save(fig, "captions_cdf.png")
    return files
