"""One student's audio path: decoded frames -> 16 kHz mono -> VAD -> Utterances (and, while the
student speaks, hints: partial and speculative Utterances of the same utterance_id).

A student whose page keeps its audio (audio/timeline.py) is told how far its audio is safe
(ack()): up to the oldest utterance not yet published, or the speech in progress. After a break
the page sends the rest again as catch-up; the new live audio is held meanwhile and follows it,
so the VAD sees one stream in the order it was spoken.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import av
import numpy as np

from engines.features import SAMPLE_RATE
from streamserver.audio.pacing import Pacer
from streamserver.audio.resample import To16kMono
from streamserver.audio.sent_again import silence_sent
from streamserver.audio.segmenter import SegmentedSpeech, SegmenterConfig, UtteranceSegmenter
from streamserver.audio.timeline import StreamClock
from streamserver.events import Utterance, audio_digest, now
from streamserver.stages import UtteranceTaker

log = logging.getLogger(__name__)

# Live audio waits this long for a catch-up to begin, and then for each next piece of it; a page
# that goes quiet mid-way loses the rest of its catch-up, never its live audio.
CATCH_UP_WAIT_S = 10.0
SETUP_WAIT_S = 30.0  # from the offer to the page's first mark
# Live audio held behind a catch-up (2.9 MB at most): past it the live audio goes on. A page keeps
# 60 s and sends it at 1.25x, so an honest catch-up holds ~50 s at most.
HELD_MAX_S = 90.0


class StudentAudio:
    def __init__(
        self,
        room_id: str,
        student_id: str,
        student_name: str,
        language: str,
        out: UtteranceTaker,
        on_speaking: Callable[[bool], None] | None = None,
        config: SegmenterConfig | None = None,
        pacer: Pacer | None = None,
        hints: bool = True,
        source: str = "",
    ) -> None:
        self.room_id, self.student_id, self.student_name, self.language = room_id, student_id, student_name, language
        self.source = source  # whose share of the room's queue its utterances count in (Utterance.source)
        self.out = out  # the next stage (stages.py): the utterance sink
        self._hints = hints  # hand on the speech so far, for captions and speculation
        self._on_speaking = on_speaking  # the room's "speaking" mark: an event, not the data path
        self._resample = To16kMono()
        self._segmenter = UtteranceSegmenter(config or SegmenterConfig(), self)
        self._speaking = False
        self._pacer = pacer or Pacer()
        # A page that keeps its audio (keep()): the stream clock, the utterances not yet
        # published (id -> first sample), live audio held behind a catch-up.
        self.kept = False
        self.clock = StreamClock()
        self._fed = 0  # samples fed to the VAD
        self._live_received = 0  # live samples received (fed or held)
        self._live_start: float | None = None  # stream time of the first live sample
        self._live_run = False
        self._offset: float | None = None  # server clock - stream clock
        self._unsettled: dict[str, int] = {}
        self._recovered_before = 0  # samples before this are sent again after a break
        self._held: list[np.ndarray] | None = None  # live audio waiting for the catch-up
        self._held_samples = 0
        self._wait_until = 0.0  # monotonic: the catch-up is given up after this
        self._catch_up_pacer: Pacer | None = None
        self._ack_cap: float | None = None  # a catch-up that stopped short: acks stay before its hole
        self._sent: list[tuple[float, float]] = []  # spans of the clock already queued (already_sent)
        self.stream_clock = ""
        self.said_bye = False  # the page left on purpose: its last speech is flushed, not kept
        self.closed = False
        self.live_from_told = False  # the page was told where its live audio starts

    @property
    def utterance_open(self) -> bool:
        """The VAD has an utterance open: the transport hands on a silent sender's silence on
        time (transport/dtx.py)."""
        return self._segmenter.in_utterance

    def push_frame(self, frame: av.AudioFrame) -> None:
        self.push_pcm16(self._resample.push(frame))

    def push_pcm16(self, pcm: np.ndarray) -> None:
        """Live audio. Raises TooFast (nothing of it kept) when the stream outruns real time."""
        if self.closed:  # ended (replaced, the room closed) while its transport still closes
            return
        self._pacer.take(pcm.size)
        self._live_received += pcm.size
        if self._held is not None:
            if time.monotonic() < self._wait_until and self._held_samples < HELD_MAX_S * SAMPLE_RATE:
                self._held.append(pcm)
                self._held_samples += pcm.size
                return
            log.warning("student %s: its catch-up %s", self.student_id,
                        "stalled" if time.monotonic() >= self._wait_until else f"held {HELD_MAX_S:g} s of live audio")
            self.end_catch_up()
        self._feed_live(pcm)

    def _feed_live(self, pcm: np.ndarray) -> None:
        if not self._live_run:
            self._live_run = True
            self.clock.add_run(self._fed, self._live_start)
        sent_again = self._fed < self._recovered_before  # dated when it was spoken, not now
        if sent_again:
            self._feed(self._new_only(pcm), self._spoken_at(self._fed + pcm.size))
        else:
            self._feed(pcm)

    def _spoken_at(self, sample: int) -> float | None:
        """When a sample was spoken, on the server clock (None while the clocks are not tied)."""
        at = self.clock.at(sample)
        return at + self._offset if at is not None and self._offset is not None else None

    def _feed(self, pcm: np.ndarray, ts: float | None = None) -> None:
        self._segmenter.feed(pcm, ts)
        self._fed += pcm.size
        if self._on_speaking and self._segmenter.speaking != self._speaking:
            self._speaking = self._segmenter.speaking
            self._on_speaking(self._speaking)

    # ---- a page that keeps its audio ----

    def keep(self, catch_up: bool, start: float | None = None, live_from: float | None = None,
             stream_now: float | None = None, clock: str = "") -> None:
        """The client keeps its audio and names it on its stream clock. `catch_up`: it will send
        what the server did not acknowledge (start_catch_up ...), and the live audio waits for
        it. `start`: the stream time of the first live sample, when the client says it (the
        WebSocket ingest; else the first mark places it); audio before `live_from` is sent again
        after a break. `stream_now`: the client's clock now, to date what it sends late. `clock`:
        which clock (one per page load: a reload starts again at 0)."""
        self.kept = True
        self.stream_clock = clock
        if start is not None:
            self._live_start = start
            if live_from is not None:
                self._recovered_before = max(0, round((live_from - start) * SAMPLE_RATE))
        if stream_now is not None:
            self._offset = now() - stream_now
        if catch_up:  # the first wait also covers the connection's setup (ICE, DTLS, the channel)
            self._held, self._held_samples = [], 0
            self._wait_until = time.monotonic() + SETUP_WAIT_S

    def mark(self, stream_time: float) -> float | None:
        """The page's newest sample is at `stream_time`: it places the live audio on the stream
        clock (the first mark decides). The live audio's start, once known."""
        self._offset = now() - stream_time  # the newest: the page's audio clock and ours drift apart
        if self._live_start is None:
            self._live_start = stream_time - self._live_received / SAMPLE_RATE
            self.clock.place(self._live_start)
            if self._held is not None and self._catch_up_pacer is None:  # the channel is up: the catch-up comes now
                self._wait_until = time.monotonic() + CATCH_UP_WAIT_S
        return self._live_start

    def already_sent(self, spans: list[tuple[float, float]]) -> None:
        """Spans of this page's clock whose utterances are queued already: what the page sends
        again of them is silenced before the VAD (audio/sent_again.py)."""
        self._sent = sorted(spans)

    def _new_only(self, pcm: np.ndarray) -> np.ndarray:
        start = self.clock.at(self._fed)
        return silence_sent(pcm, start, self._sent) if self._sent and start is not None else pcm

    @property
    def catching_up(self) -> bool:
        return self._held is not None

    def start_catch_up(self, start: float, pacer: Pacer) -> None:
        """Audio sent again from stream time `start`, up to the live audio's start (once per
        connection: ValueError for a second)."""
        if self._held is None or self._catch_up_pacer is not None:
            raise ValueError("one catch-up per connection, announced by its offer")
        self.clock.add_run(self._fed, start)
        self._catch_up_pacer = pacer
        self._wait_until = time.monotonic() + CATCH_UP_WAIT_S

    def push_catch_up(self, pcm: np.ndarray) -> None:
        """A piece of the catch-up (TooFast past the pacing limits), dated when it was spoken."""
        if self.closed:
            return
        if self._held is None or self._catch_up_pacer is None:
            raise ValueError("no catch-up is under way")
        self._catch_up_pacer.take(pcm.size)
        self._feed(self._new_only(pcm), self._spoken_at(self._fed + pcm.size))
        self._wait_until = time.monotonic() + CATCH_UP_WAIT_S

    def end_catch_up(self, complete: bool = False) -> None:
        """The catch-up is over (`complete`: the page says so) or given up: the held live audio
        follows it."""
        if self._held is None:
            return
        if not complete:
            # What the catch-up did not bring is never acknowledged: the page keeps it, and sends
            # it again after its next break (if it still has it).
            sent_to = self.clock.at(self._fed) if self._catch_up_pacer is not None else None
            self._ack_cap = sent_to if sent_to is not None else 0.0  # none came: where it began is the page's
            log.warning("student %s: its catch-up %s; its live audio goes on", self.student_id,
                        "stopped before the live audio" if self._catch_up_pacer is not None else "never came")
        held, self._held = self._held, None
        self._recovered_before = self._fed
        for pcm in held:
            self._feed_live(pcm)

    def ack(self) -> float | None:
        """How far the client's audio is safe, on its stream clock: everything before is in a
        published utterance or was not speech. None until the stream is placed."""
        if self.closed:  # its speech in progress may have been dropped for the page to send again
            return None
        safe = self.clock.at(min([self._segmenter.safe_sample, *self._unsettled.values()]))
        if safe is not None and self._ack_cap is not None:
            safe = min(safe, self._ack_cap)
        return safe

    def unsettled(self) -> list[str]:
        return list(self._unsettled)

    def settle(self, utterance_ids: set[str]) -> None:
        for uid in utterance_ids:
            self._unsettled.pop(uid, None)

    def close(self, flush: bool = True) -> None:
        """The stream ended. Without `flush` the speech in progress is dropped: the page sends it
        again (a reconnect that catches up)."""
        self.closed = True
        if flush:
            self.end_catch_up()  # the live audio held behind a catch-up is the student's too
            self._segmenter.flush()
        else:
            self._segmenter.discard()
        if self._speaking and self._on_speaking:
            self._speaking = False
            self._on_speaking(False)

    def speech(self, speech: SegmentedSpeech) -> None:
        """The VAD cut an utterance: to the sink."""
        u = self._utterance(speech)
        if self.kept:
            u.stream_span = self.clock.span(speech.first_sample, speech.audio.size)
            u.recovered = self._held is not None or speech.first_sample < self._recovered_before
            u.stream_clock = self.stream_clock
            self._unsettled[u.utterance_id] = speech.first_sample
        self.out.submit(u)

    def speech_so_far(self, speech: SegmentedSpeech) -> None:
        """The utterance in progress so far: a hint to the sink. None of speech sent again after
        a break: it is not live."""
        if self._hints and self._held is None and speech.first_sample >= self._recovered_before:
            self.out.hint(self._utterance(speech))

    def _utterance(self, speech: SegmentedSpeech) -> Utterance:
        return Utterance(
            utterance_id=speech.key,
            room_id=self.room_id,
            student_id=self.student_id,
            student_name=self.student_name,
            language=self.language,
            audio=speech.audio,
            start_ts=speech.start_ts,
            end_of_speech_ts=speech.end_of_speech_ts,
            cut=speech.cut,
            kind=speech.kind,
            revision=speech.revision,
            # a final and its speculation carry it, to be matched; a partial needs none
            digest=audio_digest(speech.audio) if speech.kind != "partial" else "",
            source=self.source,
        )
