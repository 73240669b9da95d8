"""The load simulator: its turn-taking plan, and a small real run against `serve` with Redis."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from streamserver.loadsim import report
from streamserver.loadsim.measure import Tally
from streamserver.loadsim.run import parse_queue_depth
from streamserver.loadsim.scenario import MIN_GAP_S, load_clips, plan_turns
from tests.server_process import ADMIN_TOKEN, ServerProcess


@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.3])
def test_turns_keep_gaps_and_the_speak_ratio(ratio):
    clips = load_clips()
    spoken = total = 0.0
    for seed in range(200):
        turns = plan_turns(clips, 120.0, ratio, random.Random(seed))
        for before, after in zip(turns, turns[1:]):
            assert after.start_s - before.end_s >= MIN_GAP_S - 1e-9  # one utterance per clip
        assert all(t.end_s + MIN_GAP_S <= 120.0 for t in turns)  # complete before the stream ends
        spoken += sum(t.clip.duration_s for t in turns)
        total += 120.0
    assert spoken / total == pytest.approx(ratio, rel=0.25)


def test_queue_depth_from_prometheus_text():
    text = "# TYPE streamserver_queue_depth gauge\nstreamserver_queue_depth 3\nstreamserver_queue_depth_max 9\n"
    assert parse_queue_depth(text) == 3
    assert parse_queue_depth('streamserver_queue_depth{room="a"} 2 1700000000\nstreamserver_queue_depth{room="b"} 1.5\n') == 3.5
    assert parse_queue_depth("other_metric 1\n") is None


def test_lost_counts_the_clips_students_said():
    """lost = clips sent minus transcripts, student by student: a clip the gateway never turned
    into an utterance is lost, and an extra transcript of one student never makes up for a
    missing one of another; the gateway's own basis (queued without a transcript) stays beside it."""
    tally = Tally(t0=0.0)
    for student, clips in (("ann", 2), ("bo", 3), ("cy", 1)):
        for _ in range(clips):
            tally.clip_sent(student)
    queued = {"u1": "ann", "u2": "ann", "u3": "ann", "u4": "bo", "u5": "bo", "u6": "cy"}  # ann: one clip cut in two
    for uid, student in queued.items():
        tally.feed_event({"type": "utterance_queued", "utterance_id": uid, "student_id": student}, 1.0, False)
    tally.feed_event({"type": "utterance_queued", "utterance_id": "u1", "student_id": "ann"}, 1.0, True)  # a replay
    for uid in ("u1", "u2", "u3", "u4"):  # u5 and u6 never come back; one of bo's clips never became an utterance
        tally.feed_event({"type": "transcript", "utterance_id": uid, "student_id": queued[uid], "end_of_speech_ts": 0.5}, 1.0, False)
    tally.feed_event({"type": "transcript", "utterance_id": "u4", "student_id": "bo", "end_of_speech_ts": 0.5}, 1.2, False)
    tally.clips_unsent = 1
    result = report.build({}, tally, [], False)
    assert result["utterances_sent"] == 6 and result["transcripts_received"] == 4 and result["duplicates"] == 1
    assert result["lost"] == 3  # bo: 3 clips, 1 transcript; cy: 1 clip, none; ann's extra makes up for neither
    assert result["lost_vs_queued"] == 2  # u5, u6: queued, never transcribed
    assert result["never_queued"] == 1  # bo's third clip
    assert result["clips_unsent"] == 1 and result["utterances_queued"] == 6
    assert tally.pending() == 3

    # A speech published twice under two ids (a copy of a recovered utterance) is a duplicate and
    # makes up for no lost clip: two transcripts of one student overlapping in time.
    twice = Tally(t0=0.0)
    twice.clip_sent("ann")
    twice.clip_sent("bo")
    for uid, student, start in (("a1", "ann", 10.0), ("a2", "ann", 10.1), ("b1", "bo", 10.0)):
        twice.feed_event({"type": "transcript", "utterance_id": uid, "student_id": student, "start_ts": start,
                          "end_of_speech_ts": start + 2.0}, 13.0, False)
    assert twice.copies == 1 and twice.duplicates == 1 and twice.lost() == 0 and len(twice.transcripts) == 2

    silent = Tally(t0=0.0)  # a server that announces nothing: the clips still count
    silent.clip_sent("ann")
    assert silent.lost() == 1 and silent.lost_vs_queued() is None and silent.never_queued() is None


def test_latency_from_the_students_clock():
    """Beside the latency from the server's end_of_speech_ts, the one from the moment the clip's
    last audio left the student: audio that reached a backlogged server 2 s late shows in it."""
    tally = Tally(t0=0.0)
    for student in ("ann", "ann", "bo"):
        tally.clip_sent(student)
    tally.sent_at = {"ann": [10.0, 20.0], "bo": [30.0]}
    events = [("u1", "ann", 12.0, 12.8), ("u2", "ann", 20.1, 20.9), ("u3", "bo", 30.1, 30.9), ("u4", "bo", 40.0, 40.5)]
    for uid, student, eos, arrived in events:
        tally.feed_event({"type": "transcript", "utterance_id": uid, "student_id": student, "end_of_speech_ts": eos}, arrived, False)
    assert sorted(np.round(tally.latencies(), 3)) == [0.5, 0.8, 0.8, 0.8]
    assert sorted(np.round(tally.latencies_from_clip_end(), 3)) == [0.9, 2.8]  # bo's two transcripts for one clip: left out
    assert report.build({}, tally, [], False)["latency_from_clip_end_s"]["max"] == pytest.approx(2.8)


def test_live_caption_figures():
    """Partials: first one from the speech start, gaps between them, the last one's agreement
    with the final, and any that came after its final."""
    tally = Tally(t0=0.0)
    def partial(uid: str, text: str, at: float) -> None:
        tally.feed_event({"type": "transcript_partial", "utterance_id": uid, "student_id": "ann", "start_ts": 10.0,
                          "text": text}, at, False)
    partial("u1", "the cat", 11.2)
    partial("u1", "the cat sat on", 12.5)
    tally.feed_event({"type": "transcript", "utterance_id": "u1", "student_id": "ann", "end_of_speech_ts": 13.0,
                      "text": "The cat sat on the mat."}, 13.6, False)
    partial("u1", "the cat sat", 13.7)  # after its final
    stats = tally.partial_stats()
    assert stats["partials_received"] == 3 and stats["partials_after_final"] == 1
    assert stats["partial_first_s"]["p50"] == pytest.approx(1.2)
    assert stats["partial_gap_s"]["max"] == pytest.approx(1.3)
    assert stats["partial_agreement"] == {"mean": pytest.approx(4 / 6, abs=1e-4), "p10": pytest.approx(4 / 6, abs=1e-4),
                                          "utterances": 1}


def test_first_caption_from_the_students_clock():
    """The first caption also from when the clip's speech left the student (its first frame plus
    its speech onset): audio that reached the server 1 s late shows in it, not in partial_first_s."""
    tally = Tally(t0=0.0)
    tally.speech_left = {"ann": [10.0, 20.0], "bo": [30.0]}
    tally.sent_at = {"ann": [13.0, 24.0], "bo": [33.0]}
    events = [("u1", "ann", 10.1, 11.0), ("u2", "ann", 21.0, 22.0), ("u3", "bo", 30.1, 31.0), ("u4", "cy", 5.0, 6.0),
              ("u5", "ann", 22.5, 23.2),  # ann's second clip cut in two by the VAD: counted by its first utterance
              ("u6", "bo", 40.0, 41.0)]  # after bo's clip ended: not paired with it
    for uid, student, start, arrived in events:
        tally.feed_event({"type": "transcript_partial", "utterance_id": uid, "student_id": student, "start_ts": start,
                          "text": "x"}, arrived, False)
    assert sorted(np.round(tally.partial_first_from_speech(), 3)) == [1.0, 1.0, 2.0]  # u2 reached the server 1 s late; cy: no clip
    assert tally.partial_stats()["partial_first_s"]["max"] == pytest.approx(1.0)
    assert tally.partial_stats()["partial_first_from_speech_s"]["max"] == pytest.approx(2.0)


def test_a_clips_speech_onset_is_after_its_quiet_lead_in():
    from streamserver.loadsim.scenario import speech_onset_s

    rng = np.random.default_rng(0)
    pcm = np.concatenate([rng.normal(0, 30, 4000), rng.normal(0, 8000, 8000), rng.normal(0, 30, 1600)]).astype("<i2")
    assert speech_onset_s(pcm) == pytest.approx(0.25)
    assert speech_onset_s(np.zeros(0, "<i2")) == 0.0

def test_small_class_over_websocket(redis_url, tmp_path):
    """4 students in one room for 20 s (in two processes): every clip sent comes back once, none
    lost, plots drawn."""
    with ServerProcess("--redis-url", redis_url) as server:
        run = subprocess.run(
            [sys.executable, "-m", "streamserver.loadsim", "--url", server.url, "--students", "4", "--rooms", "1",
             "--duration", "20", "--speak-ratio", "0.3", "--transport", "ws", "--processes", "2", "--report", str(tmp_path)],
            env=dict(os.environ, STREAMSERVER_ADMIN_TOKEN=ADMIN_TOKEN), capture_output=True, text=True, timeout=120,
        )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "loadsim:" in run.stderr and "transcripts" in run.stderr  # progress once a second
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["students"] == 4 and report["rooms"] == 1 and report["transport"] == "ws"
    assert report["duration_s"] == 20 and report["speak_ratio"] == 0.3
    assert report["utterances_sent"] > 0 and report["transcripts_received"] > 0
    assert report["duplicates"] == 0 and report["lost"] == 0 and report["lost_vs_queued"] == 0 and report["never_queued"] == 0
    assert report["clips_unsent"] == 0 and report["utterances_queued"] == report["utterances_sent"]
    assert "lost 0 (queued without transcript 0, never queued 0)" in run.stderr  # the summary line
    assert report["transcripts_received"] == report["utterances_sent"]  # one transcript per clip
    assert report["join_failures"] == 0 and report["busy_rejections"] == 0 and report["disconnects"] == 0
    latency = report["latency_s"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"] < 5
    from_clip_end = report["latency_from_clip_end_s"]  # every student's clips and transcripts pair up here
    assert 0 < from_clip_end["p50"] <= from_clip_end["max"] < latency["max"] + 1
    assert len(report["timeline"]) >= 15 and max(row["connected"] for row in report["timeline"]) == 4
    for plot in ("latency_cdf.png", "latency_over_time.png", "active_speakers.png", "queue_depth.png", "captions_cdf.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # live captions (serve's default --partials auto: this class leaves the engine headroom)
    assert report["partials_received"] > 0 and report["partials_after_final"] == 0
    assert 0 < report["partial_first_s"]["p50"] < 5 and report["partial_agreement"]["utterances"] > 0
