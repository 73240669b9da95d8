"""What the load simulator counts: utterances sent, transcripts seen on the dashboards, their
latency, and what never came back.

Latency = dashboard receive time (client clock) - the event's end_of_speech_ts (server clock);
the simulator and the server share a machine (or a synchronised clock) for it to mean anything.

Lost is counted against what the students said: per student, clips fully sent minus transcripts
received (a clip is one utterance, see scenario.py; an extra transcript of one student never
makes up for a missing one of another), so a clip the server never turned into an utterance is
lost. A gateway that hands utterances to a job queue announces each one in the room
(`utterance_queued`); the server-side figures are kept beside it: lost_vs_queued (announced ids
with no transcript: lost in recognition) and never_queued (per student, clips sent minus
utterances announced: lost before recognition, in the transport or the VAD). Clips the simulator
itself never finished sending (it fell behind real time, or the connection closed) are
clips_unsent, never part of utterances_sent.

latency_s starts at the server's end_of_speech_ts, the arrival of the last voiced audio: audio
that reached the server late (a backlogged transport) does not show in it. latency_from_clip_end_s
starts when the clip's last audio left the student (client clock), for the students whose
transcripts and clips pair up one to one: it is below latency_s by the quiet end of each clip
(the last voiced audio comes before the clip's end, ~0.1-0.3 s) and above it by however late the
audio reached the server.

Live captions (transcript_partial): partials_received; partial_first_s, from the utterance's
speech start (the event's start_ts, the arrival of its first voiced audio) to its first partial on
the dashboard; partial_first_from_speech_s, the same from when the clip's speech left the student
(client clock: the clip's first frame plus its speech onset, scenario.speech_onset_s), so that
audio that reached the server late shows in it; partial_gap_s, between successive partials of one utterance as received; and
partial_agreement, per utterance with partials, the share of its final's words that its last
partial has, in order (the longest common subsequence of the two word lists). A partial that
arrives after its final is counted in partials_after_final (the server should send none).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

MAX_ERRORS = 20  # distinct join/stream errors kept for the report
COUNTERS = ("join_failures", "join_retries", "busy_rejections", "never_seated", "disconnects", "clips_unsent", "ice_consent_expired", "reconnects")
# Two transcripts of one student whose speech overlaps this much (of the shorter) are one speech
# published twice, whatever their utterance ids say: a student never says two things at once.
COPY_OVERLAP = 0.5
# The VAD dates an utterance from its first voiced frame, which may be a little before the onset
# speech_onset_s finds (a soft start under its threshold)
SPEECH_PAIR_SLACK_S = 0.3


@dataclass
class Tally:
    t0: float = field(default_factory=time.time)
    utterances_sent: int = 0
    sent_by_student: Counter = field(default_factory=Counter)
    sent_at: dict[str, list[float]] = field(default_factory=dict)  # student -> when each clip's last audio left (epoch)
    sent_texts: dict[str, list[str]] = field(default_factory=dict)  # student -> what each clip sent says
    speech_left: dict[str, list[float]] = field(default_factory=dict)  # student -> when each clip's speech began to leave (epoch)
    speaking: set[str] = field(default_factory=set)
    # utterance_id -> (seconds since t0 when the dashboard got it, latency in seconds)
    transcripts: dict[str, tuple[float, float]] = field(default_factory=dict)
    received_by_student: Counter = field(default_factory=Counter)
    # student -> (end_of_speech_ts, dashboard arrival, text) of each transcript, epoch seconds
    received_at: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)
    queued: set[str] = field(default_factory=set)
    queued_ts: dict[str, float] = field(default_factory=dict)  # utterance -> its utterance_queued's ts (server clock)
    # per transcript with its announcement: (end of speech -> queued, queued -> published, published -> dashboard)
    parts: list[tuple[float, float, float]] = field(default_factory=list)
    queued_by_student: Counter = field(default_factory=Counter)
    duplicates: int = 0  # transcripts of an utterance (or a speech: copies) received again
    copies: int = 0  # of them, transcripts with ids of their own over a speech already transcribed
    recovered: int = 0  # transcripts of speech sent again after a break (their `recovered` flag)
    reconnects: int = 0  # students' reconnects after a break (students that keep their audio)
    reconnect_causes: Counter = field(default_factory=Counter)  # why they broke: "closed", "no_ack", "send_failed"
    spoken: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # student -> (start_ts, end_of_speech_ts)
    connected: int = 0
    join_failures: int = 0  # students refused for good, or whose joins got no answer until the class ended
    join_retries: int = 0  # joins that got no answer (a reset, a timeout) and were tried again
    busy_rejections: int = 0  # joins answered busy (a student told busy tries again after Retry-After)
    never_seated: int = 0  # students answered busy on every try until the class ended
    disconnects: int = 0
    clips_unsent: int = 0  # clips of the students' plans the simulator did not finish sending
    ice_consent_expired: int = 0  # students' connections closed by their own side: the server stopped answering consent checks
    max_lag_s: float = 0.0
    errors: Counter = field(default_factory=Counter)
    partials_received: int = 0
    partials_after_final: int = 0
    # utterance -> (student, its start_ts on the server clock, dashboard arrival of its first partial)
    partial_first: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    partial_gaps: list[float] = field(default_factory=list)
    # utterance -> (dashboard arrival of its latest partial, that partial's text)
    last_partial: dict[str, tuple[float, str]] = field(default_factory=dict)
    partial_agreement: list[float] = field(default_factory=list)  # per utterance with partials, at its final
    # students run by child processes (run.py): their latest (connected, speaking) and snapshot
    remote: dict[int, tuple[int, int]] = field(default_factory=dict)
    _last: dict[int, dict] = field(default_factory=dict, repr=False)

    # -- what the students do --------------------------------------------------------------
    def clip_started(self, student_id: str, onset_s: float = 0.0) -> None:
        self.speaking.add(student_id)
        self.speech_left.setdefault(student_id, []).append(time.time() + onset_s)

    def clip_sent(self, student_id: str, text: str = "") -> None:
        self.speaking.discard(student_id)
        self.utterances_sent += 1
        self.sent_by_student[student_id] += 1
        self.sent_at.setdefault(student_id, []).append(time.time())
        self.sent_texts.setdefault(student_id, []).append(text)

    def lag(self, seconds: float) -> None:
        self.max_lag_s = max(self.max_lag_s, seconds)

    def error(self, kind: str, message: str) -> None:
        key = f"{kind}: {message[:200]}"
        if key in self.errors or len(self.errors) < MAX_ERRORS:
            self.errors[key] += 1

    def connected_now(self) -> int:
        return self.connected + sum(c for c, _ in self.remote.values())

    def speaking_now(self) -> int:
        return len(self.speaking) + sum(s for _, s in self.remote.values())

    # -- students in other processes -------------------------------------------------------
    def snapshot(self) -> dict:
        """The student side of this tally, cumulative, for the parent process (child.py)."""
        return {"sent": dict(self.sent_by_student), "sent_at": self.sent_at, "sent_texts": self.sent_texts,
                "speech_left": self.speech_left, "connected": self.connected, "speaking": len(self.speaking),
                "max_lag_s": self.max_lag_s, "errors": dict(self.errors), "causes": dict(self.reconnect_causes),
                **{k: getattr(self, k) for k in COUNTERS}}

    def absorb(self, child: int, snap: dict) -> None:
        """Fold in a child's snapshot: what changed since its previous one."""
        last = self._last.get(child) or {"sent": {}, "errors": {}, "causes": {}, **{k: 0 for k in COUNTERS}}
        for student_id, n in snap["sent"].items():
            new = n - last["sent"].get(student_id, 0)
            self.sent_by_student[student_id] += new
            self.utterances_sent += new
        self.sent_at.update(snap.get("sent_at", {}))  # each student lives in one child: its whole list
        self.sent_texts.update(snap.get("sent_texts", {}))
        self.speech_left.update(snap.get("speech_left", {}))
        for key in COUNTERS:
            setattr(self, key, getattr(self, key) + snap[key] - last[key])
        for key, n in snap["errors"].items():
            self.errors[key] += n - last["errors"].get(key, 0)
        for key, n in snap.get("causes", {}).items():
            self.reconnect_causes[key] += n - last.get("causes", {}).get(key, 0)
        self.max_lag_s = max(self.max_lag_s, snap["max_lag_s"])
        self.remote[child] = (snap["connected"], snap["speaking"])
        self._last[child] = snap

    # -- what the dashboards see -----------------------------------------------------------
    def feed_event(self, event: dict, received: float, replayed: bool) -> None:
        kind = event.get("type")
        if kind == "utterance_queued":
            if event["utterance_id"] not in self.queued:
                self.queued.add(event["utterance_id"])
                self.queued_ts[event["utterance_id"]] = float(event.get("ts", 0.0))
                self.queued_by_student[event["student_id"]] += 1
        elif kind == "transcript_partial":
            self._partial(event, received)
        elif kind == "transcript":
            uid = event["utterance_id"]
            if uid in self.transcripts:
                if not replayed:  # a history replay after a reconnect repeats what we saw
                    self.duplicates += 1
                return
            span = (float(event.get("start_ts", event["end_of_speech_ts"])), float(event["end_of_speech_ts"]))
            mine = self.spoken.setdefault(event["student_id"], [])
            if "start_ts" in event and any(min(span[1], e) - max(span[0], s) >= COPY_OVERLAP * max(1e-3, min(span[1] - span[0], e - s))
                   for s, e in mine):
                self.copies += 1  # not a transcript of a clip: one counted already
                self.duplicates += 1
                return
            mine.append(span)
            if event.get("recovered"):
                self.recovered += 1
            if uid in self.last_partial:
                self.partial_agreement.append(word_agreement(self.last_partial.pop(uid)[1], event.get("text", "")))
            self.transcripts[uid] = (received - self.t0, received - float(event["end_of_speech_ts"]))
            if not replayed and (queued := self.queued_ts.get(uid)) and "published_ts" in event:
                end, published = float(event["end_of_speech_ts"]), float(event["published_ts"])
                self.parts.append((queued - end, published - queued, received - published))
            self.received_by_student[event["student_id"]] += 1
            self.received_at.setdefault(event["student_id"], []).append(
                (float(event["end_of_speech_ts"]), received, event.get("text", "")))

    def _partial(self, event: dict, received: float) -> None:
        uid = event["utterance_id"]
        self.partials_received += 1
        if uid in self.transcripts:
            self.partials_after_final += 1
            return
        if uid not in self.partial_first:
            self.partial_first[uid] = (event["student_id"], float(event["start_ts"]), received)
        if uid in self.last_partial:
            self.partial_gaps.append(received - self.last_partial[uid][0])
        self.last_partial[uid] = (received, event.get("text", ""))

    def partial_stats(self) -> dict:
        agreement = np.asarray(self.partial_agreement, dtype=float)
        return {
            "partials_received": self.partials_received,
            "partials_after_final": self.partials_after_final,
            "utterances_with_partials": len(self.partial_first),
            "partial_first_s": latency_summary(self.partial_first_seconds()),
            "partial_first_from_speech_s": latency_summary(self.partial_first_from_speech()),
            "partial_gap_s": latency_summary(self.partial_gaps),
            "partial_agreement": {"mean": round(float(agreement.mean()), 4) if agreement.size else None,
                                  "p10": round(float(np.percentile(agreement, 10)), 4) if agreement.size else None,
                                  "utterances": int(agreement.size)},
        }

    def partial_first_seconds(self) -> list[float]:
        """Per utterance with a caption: its speech start (start_ts) -> its first caption on the dashboard."""
        return [received - start_ts for _, start_ts, received in self.partial_first.values()]

    def partial_first_from_speech(self) -> list[float]:
        """Per clip with a caption: its first caption's dashboard arrival minus when the clip's
        speech began to leave the student. An utterance belongs to the student's latest clip
        whose speech left before the utterance's start reached the server (+ SPEECH_PAIR_SLACK_S:
        the two clocks are one machine's, or synchronised), if it started before that clip ended;
        a clip the VAD cut in two counts once, by its first utterance."""
        first: dict[tuple[str, float], tuple[float, float]] = {}  # (student, speech left) -> (start_ts, first caption)
        for student, start_ts, received in self.partial_first.values():
            left = [t for t in self.speech_left.get(student, ()) if t <= start_ts + SPEECH_PAIR_SLACK_S]
            if not left:
                continue
            clip = max(left)
            ended = min((t for t in self.sent_at.get(student, ()) if t >= clip), default=float("inf"))
            if start_ts > ended + SPEECH_PAIR_SLACK_S:
                continue  # after that clip: speech the simulator did not plan (or a clip it lost)
            if (student, clip) not in first or start_ts < first[(student, clip)][0]:
                first[(student, clip)] = (start_ts, received - clip)
        return [seconds for _, seconds in first.values()]

    # -- results ---------------------------------------------------------------------------
    def lost(self) -> int:
        """Clips sent with no transcript, student by student."""
        return self._short(self.received_by_student)

    def lost_vs_queued(self) -> int | None:
        """Utterances the gateway announced with no transcript; None from a server that does not
        announce them."""
        return len(self.queued - self.transcripts.keys()) if self.queued else None

    def never_queued(self) -> int | None:
        """Clips sent that the gateway never announced as an utterance, student by student; None
        from a server that does not announce them."""
        return self._short(self.queued_by_student) if self.queued else None

    def _short(self, got: Counter) -> int:
        return sum(max(0, n - got[s]) for s, n in self.sent_by_student.items())

    def pending(self) -> int:
        """What is still expected: the drain at the end waits for this to reach 0."""
        return max(self.lost(), self.lost_vs_queued() or 0)

    def latencies(self) -> np.ndarray:
        return np.array([lat for _, lat in self.transcripts.values()], dtype=float)

    def latencies_from_clip_end(self) -> np.ndarray:
        """Dashboard arrival minus the time the clip's last audio left the student, for students
        whose transcripts and clips pair up one to one (in order)."""
        out = []
        for student, sent in self.sent_at.items():
            got = sorted(self.received_at.get(student, []))
            if len(got) == len(sent):
                out += [arrived - left for (_, arrived, _), left in zip(got, sorted(sent))]
        return np.array(out, dtype=float)

    def transcript_pairs(self) -> list[tuple[str, str]]:
        """(what the clip says, its transcript) for students whose clips and transcripts pair up
        one to one, in order: the live path's accuracy (benchmarks score it)."""
        out = []
        for student, texts in self.sent_texts.items():
            got = sorted(self.received_at.get(student, []))
            if len(got) == len(texts):
                out += [(said, text) for said, (_, _, text) in zip(texts, got)]
        return out

    def latency_parts(self) -> dict[str, dict]:
        """Where the finals' latency went, for the transcripts whose announcement came first:
        end of speech -> queued (the hangover, and a speculative result looked up), queued ->
        published (waiting for a worker, recognition), published -> on the dashboard; and the
        same three parts of the slowest 1 % (their means)."""
        if not self.parts:
            return {}
        parts = np.asarray(self.parts, dtype=float)
        slowest = parts[np.argsort(parts.sum(axis=1))[-max(1, len(parts) // 100):]]
        names = ("to_queue_s", "queue_to_published_s", "delivery_s")
        return {**{name: latency_summary(parts[:, i]) for i, name in enumerate(names)},
                "slowest_1pct_mean_s": {name: round(float(slowest[:, i].mean()), 4) for i, name in enumerate(names)}}

    def latency_stats(self, values: np.ndarray | None = None) -> dict[str, float | None]:
        return latency_summary(self.latencies() if values is None else values)


def words(text: str) -> list[str]:
    return re.findall(r"[\w']+", text.lower())


def word_agreement(partial: str, final: str) -> float:
    """Share of the final's words that the partial has, in order (longest common subsequence)."""
    a, b = words(partial), words(final)
    if not b:
        return 1.0
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
    return row[-1] / len(b)


def latency_summary(values: np.ndarray | list[float]) -> dict[str, float | None]:
    """p50, p90, p99, max and mean of latencies in seconds, as every report writes them."""
    values = np.asarray(values, dtype=float)
    if not values.size:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {k: round(float(v), 4) for k, v in
            {"p50": p50, "p90": p90, "p99": p99, "max": values.max(), "mean": values.mean()}.items()}
