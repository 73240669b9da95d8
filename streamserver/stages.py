"""The data path of an utterance, stage by stage, in order. Each stage hands its output to the
next with one plain method call on a typed interface declared here, so reading this file top to
bottom follows an utterance from a student's microphone to the teacher's dashboard; the module
named at each stage is where it lives.

1. transport       transport/webrtc.py (its RTP: transport/rtp_audio.py) or transport/ws_ingest.py
                   decode the student's packets to 16 kHz mono int16
                   -> PcmTaker.push_pcm16(pcm)
2. student audio   audio/pipeline.py StudentAudio: the VAD (audio/segmenter.py, which hands each
                   cut back to it as a SpeechTaker) -> an Utterance; while the student speaks,
                   hints (the speech so far)
                   -> UtteranceTaker.submit(u) / UtteranceTaker.hint(u)
3. utterance sink  queue/sink.py UtteranceSink: a final goes to the queue (or the spool while it
                   is away; a final whose speculative result is ready is published from it: 5)
                   -> UtteranceQueue.submit(u)   (queue/base.py: in memory or a Redis Stream)
4. recogniser      asr/worker.py AsrWorker reads a batch of every student's utterances
                   (UtteranceQueue.read) -> Recogniser.run(batch) (asr/batch.py BatchRecogniser:
                   Whisper across the batch, then an intent label each) -> results
5. publish once    queue/publication.py: UtteranceQueue.complete(entry, u, event) (a job's result,
                   atomically with its acknowledgement) or UtteranceQueue.claim(event) (a final
                   served from its speculative result, a fallback's): the first result of an
                   utterance (and of its span of the student's clock) goes out, a second never
                   -> RoomFeed.publish(event)
6. room feed       bus/ordered.py OrderedPublisher -> the bus (memory or Redis pub/sub, with the
                   room's history) -> each dashboard's WebSocket (api/app.py)

tests/test_stages.py checks that the modules of stages 1-6 take no bare Callable where they
hand on to the next stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from streamserver.asr.batch import Result
    from streamserver.events import Event, Utterance
    from streamserver.queue.base import Entry, UtteranceQueue  # noqa: F401 - stage 3 -> 4, 5

__all__ = ["PcmTaker", "UtteranceTaker", "Recogniser", "RoomFeed"]


class PcmTaker(Protocol):
    """Stage 1 -> 2: a student's decoded audio, in order, as it arrives."""

    def push_pcm16(self, pcm: np.ndarray) -> None: ...


class UtteranceTaker(Protocol):
    """Stage 2 -> 3: a final utterance to recognise, or a hint (partial or speculative)."""

    def submit(self, u: Utterance) -> None: ...

    def hint(self, u: Utterance) -> None: ...


class Recogniser(Protocol):
    """Stage 4: a batch of queued utterances, recognised together."""

    async def run(self, batch: list[Entry]) -> list[Result]: ...


class RoomFeed(Protocol):
    """Stage 5 -> 6: an event to its room's subscribers; False when the bus did not take it."""

    async def publish(self, event: Event) -> bool: ...
