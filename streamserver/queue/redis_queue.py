"""The recognition queue on a Redis Stream with one consumer group (`gateway` + `worker`).

Keys are those of streamserver/bus/keys.py. A job is acknowledged in the same Lua script that
publishes its result, so a worker that dies before that leaves the job pending, and a worker
that dies after it leaves nothing to redo. Pending jobs of a worker whose heartbeat expired are
claimed by a live one within about a second; any job idle longer than the visibility timeout is
claimed too (a worker alive but stuck).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ResponseError

from streamserver.bus.connect import redis_client
from streamserver.bus.keys import (
    BACKLOG, HISTORY_FIELD, JOB_GROUP, JOBS, TRANSCRIPT_RETENTION_S, WORKERS, alive_key, attempts_key, backlog_fields, done_key,
    history_key, is_final_transcript, room_channel, transcript_key,
)
from streamserver.events import TranscriptEvent, Utterance
from streamserver.queue.base import Bounds, Entry, QueueFull
from streamserver.queue.jobs import JobError, decode_job, encode_job

log = logging.getLogger(__name__)

# A worker silent this long is dead and its jobs go to another: 4 missed heartbeats. Short,
# because its utterances wait that long; a stalled but live worker only loses duplicate work
# (publication stays once per utterance).
ALIVE_TTL_S = 1.0
DONE_TTL_S = 24 * 3600
CLAIM_MIN_IDLE_MS = 500  # two workers claiming at once: the second finds the jobs just claimed
FORGET_IDLE_MS = 10 * 60 * 1000  # a consumer with nothing pending, silent this long, is removed

# Queue a job unless its student, its room or the whole queue is at its bound (the backlog
# counts are kept with the stream, atomically). KEYS: stream, backlog; ARGV: room field, student
# field, total, per room, per student, then the job's field/value pairs. The entry id, or the
# name of the bound reached.
_SUBMIT = """
if tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0') >= tonumber(ARGV[5]) then return 'student' end
if tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0') >= tonumber(ARGV[4]) then return 'room' end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[3]) then return 'total' end
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
return {redis.call('XADD', KEYS[1], '*', unpack(ARGV, 6))}
"""

# Publish an utterance's result once: the done key decides (SET NX); the first result is
# published, appended to the room's history, and a final also to the class transcript. Shared by
# the worker's completion and the fallback's claim, so both go through one guard.
# publish_once(done, history, transcript, channel, event, history length, done TTL, history
# field, is a final ('1'/'0'), retention) -> whether this result was the first.
_PUBLISH_ONCE = """
local function publish_once(done, history, transcript, channel, event, history_len, ttl, field, final, retention)
  if not redis.call('SET', done, '1', 'NX', 'EX', ttl) then return false end
  redis.call('PUBLISH', channel, event)
  redis.call('XADD', history, 'MAXLEN', '~', history_len, '*', field, event)
  if final == '1' then
    redis.call('RPUSH', transcript, event)
    redis.call('EXPIRE', transcript, retention)
  end
  return true
end
"""

# The worker's completion: publish once, acknowledge and delete the job, and count it out of the
# backlog (once: only the delivery that deletes it): atomically, so that no crash can publish
# twice or acknowledge without publishing. KEYS: done, history, jobs, backlog, class transcript;
# ARGV: channel, event, history length, group, entry id, done TTL, history field, the two
# backlog fields, is a final, retention.
_COMPLETE = _PUBLISH_ONCE + """
local fresh = publish_once(KEYS[1], KEYS[2], KEYS[5], ARGV[1], ARGV[2], ARGV[3], ARGV[6], ARGV[7], ARGV[10], ARGV[11])
redis.call('XACK', KEYS[3], ARGV[4], ARGV[5])
if redis.call('XDEL', KEYS[3], ARGV[5]) == 1 then
  for i = 8, 9 do
    if redis.call('HINCRBY', KEYS[4], ARGV[i], -1) <= 0 then redis.call('HDEL', KEYS[4], ARGV[i]) end
  end
end
if fresh then return 1 else return 0 end
"""

# A result made outside the workers (an on-prem gateway's local fallback): published only if no
# worker published this utterance first; its job, if queued, is then acknowledged by whichever
# worker reads it (the done key). KEYS: done, history, class transcript; ARGV: channel, event,
# history length, done TTL, history field, is a final (1/0), retention.
_CLAIM = _PUBLISH_ONCE + """
if publish_once(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]) then
  return 1
end
return 0
"""


class RedisQueue:
    # Workers read the stream in arrival order: per-room fair share holds within what a worker
    # has read (its next batch), not across the whole backlog.
    fair = False
    def __init__(self, url: str, worker: str | None = None, *, visibility_s: float = 30.0, history_len: int = 500,
                 bounds: Bounds = Bounds(), ca_file: str | None = None,
                 transcript_retention_s: int = TRANSCRIPT_RETENTION_S) -> None:
        self.transcript_retention_s = transcript_retention_s
        self.worker = worker
        self.bounds = bounds
        self.visibility_ms = int(visibility_s * 1000)
        self.history_len = history_len
        # Binary replies: the audio field is bytes. A few quick retries get a pooled connection
        # that a Redis restart closed replaced at once; a job sent twice that way is still
        # published once (the done key).
        self.redis = redis_client(
            # socket_timeout: a half-open connection must fail, not hang a worker or a gateway
            # for hours (reads block at most 200 ms by design).
            url, ca_file, decode_responses=False, socket_connect_timeout=5, socket_timeout=5, socket_keepalive=True,
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=3),
        )
        self._complete = self.redis.register_script(_COMPLETE)
        self._submit = self.redis.register_script(_SUBMIT)
        self._claim = self.redis.register_script(_CLAIM)
        self._group_ready = False

    async def close(self) -> None:
        await self.redis.aclose()

    # ---- gateway side ----

    async def submit(self, u: Utterance) -> str:
        b = self.bounds
        fields = [item for pair in encode_job(u).items() for item in pair]
        reply = await self._submit(keys=[JOBS, BACKLOG], args=[*backlog_fields(u.room_id, u.student_id),
                                                               b.total, b.per_room, b.per_student, *fields])
        if not isinstance(reply, list):
            scope = reply.decode()
            raise QueueFull(scope, {"student": b.per_student, "room": b.per_room}.get(scope, b.total))
        return reply[0].decode()

    async def depth(self) -> int:
        """Jobs not yet published: waiting plus being transcribed."""
        return int(await self.redis.xlen(JOBS))

    async def backlog(self) -> dict[str, int]:
        counts = await self.redis.hgetall(BACKLOG)
        return {k.decode()[2:]: int(v) for k, v in counts.items() if k.startswith(b"r:") and int(v) > 0}

    async def capacity(self) -> tuple[int, float]:
        """Live workers and their summed recent throughput (utterances/s). Alive = its heartbeat
        key exists: Redis's clock decides, so hosts whose clocks disagree do not hide workers."""
        stats = await self.redis.hgetall(WORKERS)
        names = list(stats)
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.exists(alive_key(name.decode() if isinstance(name, bytes) else name))
            alive = await pipe.execute() if names else []
        workers, rate = 0, 0.0
        for name, is_alive in zip(names, alive):
            if is_alive:
                workers += 1
                rate += float(json.loads(stats[name]).get("utt_per_s", 0.0))
        return workers, rate

    async def is_done(self, utterance_id: str) -> bool:
        """A worker (or a claim) has published this utterance."""
        return bool(await self.redis.exists(done_key(utterance_id)))

    async def claim(self, event: TranscriptEvent) -> bool:
        """Publish a result made outside the workers unless the utterance was published already
        (True: this one is the room's)."""
        keys = [done_key(event.utterance_id), history_key(event.room_id), transcript_key(event.room_id)]
        event_json = event.to_json()
        args = [room_channel(event.room_id), event_json, self.history_len, int(DONE_TTL_S), HISTORY_FIELD,
                int(is_final_transcript(event_json)), self.transcript_retention_s]
        return bool(await self._claim(keys=keys, args=args))

    # ---- worker side ----

    async def ensure_group(self) -> None:
        """Create the group (and the stream) once; after a Redis restart without its data too."""
        try:
            await self.redis.xgroup_create(JOBS, JOB_GROUP, id="0", mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._group_ready = True

    async def read(self, count: int, block_ms: int) -> list[Entry]:
        """New jobs for this worker (waits up to block_ms for the first)."""
        assert self.worker, "a worker name is needed to read"
        try:
            reply = await self.redis.xreadgroup(JOB_GROUP, self.worker, {JOBS: ">"}, count=count, block=block_ms)
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            await self.ensure_group()  # Redis restarted empty
            return []
        return await self._decode([(eid, fields) for _stream, entries in reply or [] for eid, fields in entries])

    async def heartbeat(self, stats: dict[str, Any]) -> None:
        assert self.worker
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(alive_key(self.worker), b"1", px=int(ALIVE_TTL_S * 1000))
            pipe.hset(WORKERS, self.worker, json.dumps({**stats, "ts": time.time()}))
            await pipe.execute()

    async def claim_orphans(self, count: int = 256) -> list[Entry]:
        assert self.worker
        claimed: list[tuple[bytes, dict]] = []
        for consumer in await self.redis.xinfo_consumers(JOBS, JOB_GROUP):
            name = consumer["name"].decode() if isinstance(consumer["name"], bytes) else consumer["name"]
            if name == self.worker or await self.redis.exists(alive_key(name)):
                continue
            if int(consumer["pending"]) == 0:
                # Forget a consumer only once it has been idle a long while: one that is just
                # starting (or whose beat lapsed briefly) may be reading right now, and deleting
                # a consumer throws away its pending jobs.
                if int(consumer.get("idle", 0)) >= FORGET_IDLE_MS:
                    await self.redis.xgroup_delconsumer(JOBS, JOB_GROUP, name)
                    await self.redis.hdel(WORKERS, name)
                continue
            pending = await self.redis.xpending_range(JOBS, JOB_GROUP, "-", "+", count, consumername=name)
            ids = [p["message_id"] for p in pending]
            if ids:
                got = await self.redis.xclaim(JOBS, JOB_GROUP, self.worker, CLAIM_MIN_IDLE_MS, ids)
                claimed += [(eid, fields) for eid, fields in got if fields]
                log.warning("claimed %d jobs of worker %s (no heartbeat)", len(got), name)
        _next, stale, *_ = await self.redis.xautoclaim(JOBS, JOB_GROUP, self.worker, self.visibility_ms, "0-0", count=count)
        claimed += [(eid, fields) for eid, fields in stale if fields]
        return await self._decode(claimed)

    async def complete(self, entry_id: str, u: Utterance, event: TranscriptEvent) -> bool:
        keys = [done_key(u.utterance_id), history_key(u.room_id), JOBS, BACKLOG, transcript_key(u.room_id)]
        event_json = event.to_json()
        args = [room_channel(u.room_id), event_json, self.history_len, JOB_GROUP, entry_id, int(DONE_TTL_S), HISTORY_FIELD,
                *backlog_fields(u.room_id, u.student_id), int(is_final_transcript(event_json)), self.transcript_retention_s]
        return bool(await self._complete(keys=keys, args=args))

    async def attempt(self, entry_id: str) -> int:
        key = attempts_key(entry_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, int(DONE_TTL_S))
            count, _ = await pipe.execute()
        return int(count)

    async def drop(self, entry_id: str) -> None:
        await self.redis.xack(JOBS, JOB_GROUP, entry_id)
        await self.redis.xdel(JOBS, entry_id)

    async def _decode(self, raw: list[tuple[bytes, dict]]) -> list[Entry]:
        out: list[Entry] = []
        for eid, fields in raw:
            entry_id = eid.decode() if isinstance(eid, bytes) else eid
            try:
                out.append((entry_id, decode_job(fields)))
            except JobError as error:  # written by something else: never retried
                log.error("dropping stream entry %s: %s", entry_id, error)
                await self.drop(entry_id)
        return out
