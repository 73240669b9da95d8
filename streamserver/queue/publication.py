"""Stage 5 of the data path (stages.py): a result is published once.

An utterance's first result goes to its room; a second never does: not from a second delivery of
its job (a stalled worker whose job another claimed), not from its speculative result and its
recognition both, not from an on-prem gateway's fallback and a worker both, and not from the
same speech sent again after a break under another utterance id (its span on the student's own
clock is covered by a published one). The rule is here in its two forms side by side: in Python
for the in-process queue (PublishedHere), and as the Redis script that applies it atomically with
the job's acknowledgement (PUBLISH_ONCE_LUA); tests/test_recovery.py holds both to the same cases.

Every result reaches it one of three ways:
- UtteranceQueue.complete(entry, u, event): a worker's recognition of a queued job;
- UtteranceQueue.claim(event): a result made outside the job path: a final served from its
  speculative result as the speech ends (final_from_speculation, used by the utterance sink), an
  on-prem gateway's fallback (asr/fallback.py);
- a worker's finals whose speculative result is ready when it reads them
  (finals_from_speculations), completed as their jobs.
"""

from __future__ import annotations

from collections import OrderedDict

from streamserver.bus.ordered import OrderedPublisher
import asyncio

from streamserver.events import TranscriptEvent, Utterance
from streamserver.queue.base import UNREACHABLE, Entry, UtteranceQueue

# A transcript is a copy of a published one when they are of one student's clock, at least one of
# the two is recovered (sent again by the page after a break: the VAD, started again at another
# point of the same audio, cuts about the same utterance), and published spans cover this much of
# its own span. Measured against its own span, so that a recovered utterance that also holds new
# speech (the VAD merged it with the published one) is published, its start twice, never lost.
SPOKEN_OVERLAP = 0.5
SPOKEN_KEPT_S = 600  # how far back (student clock seconds) published utterances are remembered
DONE_REMEMBERED = 100_000  # utterance ids kept against a second publication (in this process)
SPOKEN_STUDENTS = 20_000  # student clocks whose published spans are kept here (the most recent)


def spoken_of(student_id: str, clock: str) -> str:
    """Whose clock a transcript's span is on: a student's page load."""
    return f"{student_id}:{clock}"


def span_args(event: TranscriptEvent) -> list[str]:
    """The spoken-record arguments of the queue scripts: span start, end ('' if none), recovered."""
    if event.stream_start is None or event.stream_end is None:
        return ["", "", "0"]
    return [repr(event.stream_start), repr(event.stream_end), "1" if event.recovered else "0"]


def covered(spans: list[tuple[float, float, bool]], start: float, end: float, recovered: bool) -> bool:
    """Whether published spans (start, end, recovered) cover the span [start, end]: it is a copy."""
    shared = sum(max(0.0, min(end, e) - max(start, s)) for s, e, r in spans if recovered or r)
    return shared >= SPOKEN_OVERLAP * max(end - start, 1e-3)


# The rule in Redis: the done key decides (SET NX); the first result is published, appended to the
# room's history, and a final also to the class transcript; a result placed on its student's clock
# (span start, end; '' for none) is remembered there, and one that published ones cover is a copy.
# Shared by the worker's completion and the claim (queue/redis_queue.py _COMPLETE, _CLAIM), so
# both go through one guard. publish_once(done, history, transcript, channel, event, history
# length, done TTL, history field, is a final ('1'/'0'), retention, spoken, span start, span end,
# recovered ('1'/'0'), token) -> 1: this result was the first; 0: it was not.
# On a replicated Redis (a token given) the script does not PUBLISH: the caller does, once a
# replica holds what the script wrote (connect.Replication), so that a failover cannot lose the
# done key of a result already shown and let it be published again. The done key then holds the
# token, and the same caller asking again (its first answer lost with the connection) gets 2: its
# result is the first, written already, still to be published.
PUBLISH_ONCE_LUA = """
local function covered(spoken, s, e, recovered)
  local shared = 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', spoken, s, '+inf')) do
    local ps, pe, pr = string.match(m, '^([^,]+),([^,]+),([01]),')
    ps, pe = tonumber(ps), tonumber(pe)
    if ps and (recovered == '1' or pr == '1') then
      shared = shared + math.max(0, math.min(e, pe) - math.max(s, ps))
    end
  end
  return shared >= OVERLAP * math.max(e - s, 0.001)
end
local function publish_once(done, history, transcript, channel, event, history_len, ttl, field, final, retention,
                            spoken, span_start, span_end, recovered, token)
  local was = redis.call('GET', done)
  if was then
    if token ~= '' and was == token then return 2 end
    return 0
  end
  local s, e = tonumber(span_start), tonumber(span_end)
  if s and covered(spoken, s, e, recovered) then
    redis.call('SET', done, '2', 'EX', ttl)  -- 2: a copy of a published utterance
    return 0
  end
  if token == '' then
    redis.call('SET', done, '1', 'EX', ttl)
    redis.call('PUBLISH', channel, event)
  else
    redis.call('SET', done, token, 'EX', ttl)
  end
  redis.call('XADD', history, 'MAXLEN', '~', history_len, '*', field, event)
  if final == '1' then
    redis.call('RPUSH', transcript, event)
    redis.call('EXPIRE', transcript, retention)
  end
  if s then
    redis.call('ZADD', spoken, e, span_start .. ',' .. span_end .. ',' .. recovered .. ',' .. string.sub(done, -32))
    redis.call('ZREMRANGEBYSCORE', spoken, '-inf', e - SPOKEN_KEPT)
    redis.call('EXPIRE', spoken, SPOKEN_KEPT)
  end
  return 1
end
""".replace("OVERLAP", repr(SPOKEN_OVERLAP)).replace("SPOKEN_KEPT", str(SPOKEN_KEPT_S))


class PublishedHere:
    """The rule in this process (the in-process queue of `serve`): the utterances published, and
    each student clock's published spans, the most recent kept."""

    def __init__(self, publisher: OrderedPublisher) -> None:
        self.publisher = publisher
        self._done: OrderedDict[str, None] = OrderedDict()
        # (room, student clock) -> spans published on that clock (start, end, recovered)
        self._spoken: OrderedDict[tuple[str, str], list[tuple[float, float, bool]]] = OrderedDict()

    def __contains__(self, utterance_id: str) -> bool:
        return utterance_id in self._done

    async def publish_once(self, event: TranscriptEvent) -> bool:
        """Publish the utterance's result unless one was already; False when it was. A bus that
        does not take it raises: the caller retries, as it does when Redis is away."""
        if event.utterance_id in self._done:
            return False
        spoken = self.spoken(event.room_id, spoken_of(event.student_id, event.stream_clock))
        span = (event.stream_start, event.stream_end, event.recovered) if event.stream_start is not None else None
        if span and covered(spoken, *span):  # a copy of a published utterance, sent again after a break
            self.remember(event.utterance_id)
            return False
        # Done and recorded before the publication is awaited: an original and its copy finishing
        # together cannot both pass; a bus that refuses undoes it (the caller retries).
        self.remember(event.utterance_id)
        if span:
            spoken.append(span)
        try:
            if not await self.publisher.publish(event):
                raise ConnectionError(f"the bus did not take the result of utterance {event.utterance_id}")
        except BaseException:
            self._done.pop(event.utterance_id, None)
            if span and span in spoken:
                spoken.remove(span)
            raise
        if span:
            spoken[:] = [s for s in spoken if s[1] > span[1] - SPOKEN_KEPT_S]
        return True

    def spoken(self, room_id: str, spoken: str) -> list[tuple[float, float, bool]]:
        """A student clock's published spans (the list itself: the record to add to)."""
        return recent(self._spoken, (room_id, spoken))

    def remember(self, utterance_id: str) -> None:
        """The utterance is published (or settled as a copy): never again."""
        self._done[utterance_id] = None
        if len(self._done) > DONE_REMEMBERED:
            self._done.popitem(last=False)


def recent(records: OrderedDict, key: tuple[str, str]) -> list:
    """A student clock's record, made if new; the most recently used are kept (SPOKEN_STUDENTS)."""
    record = records.pop(key, [])
    records[key] = record
    if len(records) > SPOKEN_STUDENTS:
        records.popitem(last=False)
    return record


async def final_from_speculation(queue: UtteranceQueue, u: Utterance) -> TranscriptEvent | None:
    """The final's result from its speculative one, if one is ready for exactly its audio: the
    final then waits for no recognition at all (the sink claims it as the speech ends)."""
    speculation = await queue.speculation(u.utterance_id) if u.digest else None
    return speculation.final_for(u) if speculation else None


async def finals_from_speculations(queue: UtteranceQueue, batch: list[Entry],
                                   ) -> tuple[list[tuple[Entry, TranscriptEvent]], list[Entry], list[Entry]]:
    """A worker's finals: those whose speculative result is ready (with it), those to recognise,
    and those whose speculation another worker is recognising (to wait for)."""
    ids = [u.utterance_id for _, u in batch if u.digest]
    try:
        kept = await queue.speculations(ids) if ids else {}
    except UNREACHABLE:
        kept = {}
    ready, rest, waiting = [], [], []
    for entry in batch:
        speculation = kept.get(entry[1].utterance_id)
        event = speculation.final_for(entry[1]) if speculation else None
        if event is not None:
            ready.append((entry, event))
        elif speculation is not None and speculation.pending_for(entry[1]):
            waiting.append(entry)
        else:
            rest.append(entry)
    return ready, rest, waiting


Completion = tuple[str, Utterance, TranscriptEvent]  # (entry id, its utterance, its result)


async def complete_in_lanes(queue: UtteranceQueue, done: list[Completion]) -> list[bool | None]:
    """UtteranceQueue.complete_many through complete(): one lane a student, the lanes side by
    side, each in the order given; a job whose completion fails is None, and so are its
    student's later ones (never published in front of it)."""
    out: list[bool | None] = [None] * len(done)
    lanes: dict[tuple[str, str], list[int]] = {}
    for i, (_entry_id, u, _event) in enumerate(done):
        lanes.setdefault((u.room_id, u.student_id), []).append(i)

    async def lane(indexes: list[int]) -> None:
        for i in indexes:
            try:
                out[i] = await queue.complete(*done[i])
            except UNREACHABLE:
                return

    await asyncio.gather(*(lane(indexes) for indexes in lanes.values()))
    return out


async def complete_all(queue: UtteranceQueue, done: list[Completion]) -> list[bool | None]:
    """The queue's complete_many where it has one (a batch's completions in a few round trips),
    else its complete() in lanes."""
    many = getattr(queue, "complete_many", None)
    return await (many(done) if many is not None else complete_in_lanes(queue, done))
