"""The recognition queue on a Redis Stream with one consumer group (`gateway` + `worker`).

Keys are those of streamserver/bus/keys.py. A job is acknowledged in the same Lua script that
publishes its result, so a worker that dies before that leaves the job pending, and a worker
that dies after it leaves nothing to redo. Pending jobs of a worker whose heartbeat expired are
claimed by a live one within about a second; any job idle longer than the visibility timeout is
claimed too (a worker alive but stuck).

On a Redis Cluster the queue is one stream per shard (keys.KeyLayout): a room's jobs always go to
its shard's stream, next to the room's other keys, so that every script touches one slot and a
room's jobs keep their order; a worker reads every stream. On a replicated Redis (a cluster or a
Sentinel-managed primary) a job counts as queued, and a result as published, only once a
replica holds it (connect.Replication): a job whose write is lost in a failover is never taken
for queued (the gateway queues it again: its submit failed), and a result's done key is never
lost once the result is shown (it cannot be published a second time). Entry ids of a sharded
queue carry their shard: "<stream id>@<shard>".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ResponseError

from streamserver.bus.connect import REDIS_FAILURES as UNREACHABLE_ERRORS, Replication, is_cluster, redis_client, topology
from streamserver.bus.keys import (
    CLUSTER_SHARDS, FIRST_CAPTION_AHEAD_S, HISTORY_FIELD, JOB_GROUP, SPECULATIVE_FIRST, TRANSCRIPT_RETENTION_S, KeyLayout, backlog_fields,
    is_final_transcript,
)
from streamserver.config import Settings
from streamserver.bus.redis import PUBLISH_MANY_LUA
from streamserver.events import Event, TranscriptEvent, TranscriptPartialEvent, Utterance, now
from streamserver.queue.base import (
    HINT_MAX_AGE_S, HINTS_MAX, SPECULATION_TTL_S, Bounds, Displaced, Entry, QueueFull, Speculation, HintWish, wanted_hints,
)
from streamserver.queue.publication import PUBLISH_ONCE_LUA, SPOKEN_KEPT_S, span_args, spoken_of
from streamserver.queue.jobs import JobError, decode_job, encode_job, pack_hint_head, pcm16, unpack_hint

log = logging.getLogger(__name__)

# A worker silent this long is dead and its jobs go to another: 4 missed heartbeats. Short,
# because its utterances wait that long; a stalled but live worker only loses duplicate work
# (publication stays once per utterance). A worker whose process died is found sooner: the
# kernel closes its sockets, so its named connections leave Redis's client list at once.
ALIVE_TTL_S = 1.0
GATEWAY_ALIVE_TTL_S = 3.0  # a gateway beats every second (capacity.py)
DONE_TTL_S = 24 * 3600
# Two workers claiming at once: the second finds the jobs just claimed (idle since then < this).
CLAIM_MIN_IDLE_MS = 150
WORKER_CLIENT_PREFIX = "asr-worker:"  # the CLIENT SETNAME of every connection of a worker
# An utterance's hint audio outlives its last hint this long (its final's job, a worker's
# completion or a claim deletes it at once): a partial comes every second of voiced speech, so
# it expires only in a long pause, and the next hint then sends the audio whole again.
HINT_AUDIO_TTL_S = 10
HINT_AUDIO_REMEMBERED = 20_000  # utterances whose hint audio this gateway remembers sending
FORGET_IDLE_MS = 10 * 60 * 1000  # a consumer with nothing pending, silent this long, is removed
LIVELY_WAIT_MS = 50  # the longest a read waits for a stream's immediate re-read (a healthy one answers in ~1 ms)
SHARD_BLOCK_MS = 1000  # how long a sharded queue's read of one stream blocks (under the sockets' 5 s timeout)
ROOMS_REMEMBERED = 100_000  # utterances whose room (so shard) this process remembers (a sharded queue)

# Queue a job unless its student, its room or the whole queue is at its bound (the backlog
# counts are kept with the stream, atomically). At the room's bound, the newest waiting job
# (not yet delivered to a worker) of the source holding the most of the room gives its place, if
# the job's source holds fewer (queue/fair.py gives_way: the same rule as the memory queue's).
# The utterance's hint and its audio go (the final makes them pointless); its span on its
# student's clock is recorded (sent_key). KEYS: stream, backlog, hints, hint order, hint audio,
# sent, room jobs, shares; ARGV: room field, student field, total, per room, per student,
# utterance id, span start and end ('' for none), source, place (_place), group, then the job's
# field/value pairs. {entry id, the displaced job's room jobs element or ''}, or the name of the
# bound reached.
_SUBMIT = """
local function after(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end
local function delivered_up_to()
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == ARGV[11] then return info['last-delivered-id'] end
  end
  return '0-0'
end
local function give_way()
  local top = redis.call('ZREVRANGE', KEYS[8], 0, 0, 'WITHSCORES')
  if #top < 2 or top[1] == ARGV[9] or tonumber(redis.call('ZSCORE', KEYS[8], ARGV[9]) or '0') >= tonumber(top[2]) then
    return nil
  end
  local delivered, jobs = delivered_up_to(), redis.call('LRANGE', KEYS[7], 0, -1)
  for i = #jobs, 1, -1 do
    local cut = string.find(jobs[i], ' ', 1, true)
    local id, place = string.sub(jobs[i], 1, cut - 1), cjson.decode(string.sub(jobs[i], cut + 1))
    if not after(id, delivered) then return nil end
    if place[3] == top[1] then
      redis.call('XDEL', KEYS[1], id)
      redis.call('LREM', KEYS[7], 1, jobs[i])
      for _, field in ipairs({ARGV[1], place[5]}) do
        if redis.call('HINCRBY', KEYS[2], field, -1) <= 0 then redis.call('HDEL', KEYS[2], field) end
      end
      if tonumber(redis.call('ZINCRBY', KEYS[8], -1, top[1])) <= 0 then redis.call('ZREM', KEYS[8], top[1]) end
      return jobs[i]
    end
  end
  return nil
end
if tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0') >= tonumber(ARGV[5]) then return 'student' end
local displaced = ''
if tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0') >= tonumber(ARGV[4]) then
  displaced = give_way()
  if not displaced then return 'room' end
end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[3]) then return 'total' end
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
redis.call('ZINCRBY', KEYS[8], 1, ARGV[9])
redis.call('HDEL', KEYS[3], ARGV[6])
redis.call('ZREM', KEYS[4], ARGV[6])
redis.call('DEL', KEYS[5])
if ARGV[7] ~= '' then
  local e = tonumber(ARGV[8])
  redis.call('ZADD', KEYS[6], e, ARGV[7] .. ',' .. ARGV[8] .. ',' .. ARGV[6])
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', e - SPOKEN_KEPT)
  redis.call('EXPIRE', KEYS[6], SPOKEN_KEPT)
end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 12))
redis.call('RPUSH', KEYS[7], id .. ' ' .. ARGV[10])
return {id, displaced}
""".replace("SPOKEN_KEPT", str(SPOKEN_KEPT_S))

# Keep an utterance's newest hint, unless it is published already or HINTS_MAX wait. A partial
# that replaces a partial keeps its place in line (students are served in turn); a speculative
# hint goes to the front, an utterance's first ahead of the others (offer() scores them). Its
# audio is not in the hint: an utterance's hints hold the speech so far, each a prefix of the
# next, so the hint audio key gets only what it does not hold yet (whatever order two offers
# come in), and each sample goes through Redis once. Sent whole, the hints of a 5 s utterance
# would carry ~17 s of audio. Hints are best effort, so their writes go neither to the
# append-only file nor to replicas (REPL_NONE): with 10,000 students speaking, logging their
# audio made Redis hold the fleet's finals now and then (benchmarks/README.md, "10,000
# students: captions in turn, hints unlogged"). A Redis restarted or failed over holds none, and
# a gateway then sends an utterance's audio from its start (-1 below).
# KEYS: hints, hint order, done, hint audio;
# ARGV: utterance id, hint head, score, speculative (1/0), HINTS_MAX, byte offset of the audio
# piece, the piece, audio TTL (s). 1: offered; 2: the queue of hints is full (the piece kept);
# 0: published already; -1: the key holds less than the piece's offset (it expired): send the
# audio from 0.
_OFFER = """
redis.set_repl(redis.REPL_NONE)
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local have, offset, piece = redis.call('STRLEN', KEYS[4]), tonumber(ARGV[6]), ARGV[7]
if have < offset then return -1 end
if have - offset < #piece then redis.call('APPEND', KEYS[4], string.sub(piece, have - offset + 1)) end
redis.call('EXPIRE', KEYS[4], ARGV[8])
local old = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not old and redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) then return 2 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if ARGV[4] == '1' or not old or tonumber(old) < 0 then redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1]) end
return 1
"""

# Take up to ARGV[1] hints, front first: all kinds (ARGV[2] == '1') or speculative ones only
# (negative scores); skip those whose utterance is published (done key = ARGV[3] .. id). Each
# comes with its utterance's audio so far (hint audio key = ARGV[4] .. id): head, audio, head, ...
# KEYS: hints, hint order.
_TAKE_HINTS = """
redis.set_repl(redis.REPL_NONE)
local ids = {}
if ARGV[2] == '1' then
  local popped = redis.call('ZPOPMIN', KEYS[2], ARGV[1])
  for i = 1, #popped, 2 do ids[#ids + 1] = popped[i] end
else
  ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(0', 'LIMIT', 0, ARGV[1])
  if #ids > 0 then redis.call('ZREM', KEYS[2], unpack(ids)) end
end
local out = {}
for _, id in ipairs(ids) do
  local hint = redis.call('HGET', KEYS[1], id)
  redis.call('HDEL', KEYS[1], id)
  if hint and redis.call('EXISTS', ARGV[3] .. id) == 0 then
    out[#out + 1] = hint
    out[#out + 1] = redis.call('GET', ARGV[4] .. id) or ''
  end
end
return out
"""

# A live caption: to the room's channel (not its history) unless the utterance is published.
# KEYS: done; ARGV: channel, event.
_PARTIAL = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"""

# The worker's completion: publish once, acknowledge and delete the job, and count it out of the
# backlog and its source's share (once: only the delivery that deletes it): atomically, so that
# no crash can publish twice or acknowledge without publishing. KEYS: done, history, jobs,
# backlog, class transcript, spoken, hint audio (no more hints), room jobs, shares; ARGV: channel,
# event, history length, group, entry id, done TTL, history field, the two backlog fields, is a
# final, retention, span start, span end, recovered, source, place (_place), token
# (publication.py: '' publishes here). 1: the first result; 2: the first, this caller's, written
# already; 0: not the first. complete(k, a) reads the job's KEYS from k + 1 and its ARGV from a + 1.
COMPLETE_KEYS, COMPLETE_ARGS = 9, 17
_COMPLETE_FUNCTION = PUBLISH_ONCE_LUA + """
local function complete(k, a)
  local fresh = publish_once(KEYS[k + 1], KEYS[k + 2], KEYS[k + 5], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 6],
                             ARGV[a + 7], ARGV[a + 10], ARGV[a + 11], KEYS[k + 6], ARGV[a + 12], ARGV[a + 13], ARGV[a + 14],
                             ARGV[a + 17])
  redis.call('DEL', KEYS[k + 7])
  redis.call('XACK', KEYS[k + 3], ARGV[a + 4], ARGV[a + 5])
  if redis.call('XDEL', KEYS[k + 3], ARGV[a + 5]) == 1 then
    for i = 8, 9 do
      if redis.call('HINCRBY', KEYS[k + 4], ARGV[a + i], -1) <= 0 then redis.call('HDEL', KEYS[k + 4], ARGV[a + i]) end
    end
    redis.call('LREM', KEYS[k + 8], 1, ARGV[a + 5] .. ' ' .. ARGV[a + 16])
    if tonumber(redis.call('ZINCRBY', KEYS[k + 9], -1, ARGV[a + 15])) <= 0 then redis.call('ZREM', KEYS[k + 9], ARGV[a + 15]) end
  end
  return fresh
end
"""
_COMPLETE = _COMPLETE_FUNCTION + "return complete(0, 0)\n"
# A batch's completions on one shard in one call (every key of a shard is in its slot), in the
# order given: the KEYS and ARGV of _COMPLETE, job after job; the replies, one a job. A worker's
# batch is then a call per shard and a round trip per primary instead of a script, a WAIT and a
# PUBLISH per job (benchmarks/README.md, "A worker's own CPU: the cycle around the engine").
_COMPLETE_MANY = _COMPLETE_FUNCTION + """
local out = {}
for j = 0, #KEYS / COMPLETE_KEYS - 1 do
  out[j + 1] = complete(j * COMPLETE_KEYS, j * COMPLETE_ARGS)
end
return out
""".replace("COMPLETE_KEYS", str(COMPLETE_KEYS)).replace("COMPLETE_ARGS", str(COMPLETE_ARGS))

# A result made outside the workers (an on-prem gateway's local fallback): published only if no
# worker published this utterance first; its job, if queued, is then acknowledged by whichever
# worker reads it (the done key). KEYS: done, history, class transcript, spoken, hint audio;
# ARGV: channel, event, history length, done TTL, history field, is a final (1/0), retention,
# span start, span end, recovered, token; replies as _COMPLETE.
_CLAIM = PUBLISH_ONCE_LUA + """
redis.call('DEL', KEYS[5])
return publish_once(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7],
                    KEYS[4], ARGV[8], ARGV[9], ARGV[10], ARGV[11])
"""


def _place(u: Utterance) -> str:
    """A job's place in its room's list (after its stream id): what the submit script needs of a
    job that gives way (utterance, student, source, end of speech, the student's backlog field)."""
    return json.dumps([u.utterance_id, u.student_id, u.source, u.end_of_speech_ts, backlog_fields(u.room_id, u.student_id)[1]])


def worker_client_name(worker: str) -> str:
    """CLIENT SETNAME takes printable ASCII without spaces; worker names are host-pid-random."""
    return WORKER_CLIENT_PREFIX + "".join(c if "!" <= c <= "~" else "_" for c in worker)


class RedisQueue:
    # Workers read the stream in arrival order: per-room fair share holds within what a worker
    # has read (its next batch), not across the whole backlog.
    fair = False
    def __init__(self, url: str, worker: str | None = None, *, visibility_s: float = 30.0, history_len: int = 500,
                 bounds: Bounds = Bounds(), ca_file: str | None = None,
                 transcript_retention_s: int = TRANSCRIPT_RETENTION_S, prefix: str = Settings.redis_prefix) -> None:
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
            client_name=worker_client_name(worker) if worker else None,
        )
        kind = topology(url)
        self.keys = KeyLayout(CLUSTER_SHARDS if kind == "cluster" else 1, prefix)
        self.replication = Replication(self.redis, enabled=kind != "single")
        self._complete = self.redis.register_script(_COMPLETE)
        self._complete_many = self.redis.register_script(_COMPLETE_MANY)
        self._submit = self.redis.register_script(_SUBMIT)
        self._claim = self.redis.register_script(_CLAIM)
        self._offer = self.redis.register_script(_OFFER)
        self._take_hints = self.redis.register_script(_TAKE_HINTS)
        self._partial = self.redis.register_script(_PARTIAL)
        self._publish_many = self.redis.register_script(PUBLISH_MANY_LUA)  # as the room's bus publishes
        self._group_ready = False
        # A cluster's connections are spread over its nodes: CLIENT LIST of one tells nothing of
        # a worker's, so dead workers are found by their heartbeat there.
        self._client_list_allowed = not is_cluster(self.redis)
        # utterance -> samples of its audio this gateway put under its hint audio key (offer())
        self._hint_audio: dict[str, int] = {}
        # Sharded: utterance -> its room, for calls that name the utterance only (done_of ...).
        self._rooms: OrderedDict[str, str] = OrderedDict()
        self._readers: dict[int, asyncio.Task[list[Entry]]] = {}  # shard -> its stream's read in flight
        self._unread: list[Entry] = []  # read from the streams, not yet handed out
        self._lively: set[int] = set()  # shards whose last read brought jobs
        self._next_hint_shard = 0
        self._autoclaimed: dict[int, float] = {}  # shard -> when its stale jobs were last looked for (monotonic)
        self._published: OrderedDict[str, None] = OrderedDict()  # tokens of the results this process published

    async def close(self) -> None:
        for task in self._readers.values():
            task.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)
        await self.redis.aclose()

    # ---- shards ----

    def _note(self, utterance_id: str, room_id: str) -> int:
        """Remember an utterance's room (a sharded queue only); its shard."""
        if self.keys.shards > 1:
            self._rooms[utterance_id] = room_id
            self._rooms.move_to_end(utterance_id)
            if len(self._rooms) > ROOMS_REMEMBERED:
                self._rooms.popitem(last=False)
        return self.keys.shard(room_id)

    def _shards_of(self, utterance_id: str) -> list[int]:
        """Where an utterance's keys may be: its room's shard, or every shard for an utterance
        this process has not seen (asked about rarely: each process asks of its own)."""
        room = self._rooms.get(utterance_id)
        if room is not None or self.keys.shards == 1:
            return [self.keys.shard(room or "")]
        return list(range(self.keys.shards))

    def _entry_id(self, shard: int, stream_id: str) -> str:
        return stream_id if self.keys.shards == 1 else f"{stream_id}@{shard}"

    def _stream_id(self, entry_id: str) -> tuple[int, str]:
        stream_id, _, shard = entry_id.partition("@")
        return (int(shard) if shard else 0), stream_id

    async def _replicated(self, script: Any, keys: list[Any], args: list[Any], token: str) -> tuple[Any, str]:
        """Run a script through the replication (connect.Replication); the token its results
        carry ('' on a single Redis: its script publishes itself)."""
        if not self.replication.enabled:
            return await script(keys=keys, args=args + [""]), ""
        return await self.replication.run(script, keys, args + [token]), token

    # ---- gateway side ----

    async def submit(self, u: Utterance) -> Displaced | None:
        b = self.bounds
        fields = [item for pair in encode_job(u).items() for item in pair]
        self._hint_audio.pop(u.utterance_id, None)  # the script deletes its hint audio
        shard = self._note(u.utterance_id, u.room_id)
        span = [repr(u.stream_span[0]), repr(u.stream_span[1])] if u.stream_span is not None else ["", ""]
        sent = self.keys.sent(u.room_id, spoken_of(u.student_id, u.stream_clock))
        keys = [self.keys.jobs(shard), self.keys.backlog(shard), self.keys.hints(shard), self.keys.hint_order(shard),
                self.keys.hint_audio(shard, u.utterance_id), sent, self.keys.room_jobs(u.room_id), self.keys.shares(u.room_id)]
        args = [*backlog_fields(u.room_id, u.student_id), b.total, b.per_room, b.per_student, u.utterance_id, *span,
                u.source, _place(u), JOB_GROUP, *fields]
        # Queued once a replica holds it: a submit whose confirmation fails raises, and the sink
        # queues the utterance again (a second job of one utterance is published once).
        reply = await self.replication.run(self._submit, keys, args)
        if not isinstance(reply, list):
            scope = reply.decode()
            raise QueueFull(scope, {"student": b.per_student, "room": b.per_room}.get(scope, b.total))
        if not reply[1]:
            return None
        utterance_id, student_id, _source, end_of_speech_ts, _field = json.loads(reply[1].partition(b" ")[2])
        return Displaced(u.room_id, utterance_id, student_id, end_of_speech_ts)

    async def offer(self, hint: Utterance) -> None:
        uid, speculative = hint.utterance_id, hint.kind == "speculative"
        shard = self._note(uid, hint.room_id)
        first = uid not in self._hint_audio  # its first hint from here (a student speaks through one gateway)
        score = now() - (SPECULATIVE_FIRST if speculative else FIRST_CAPTION_AHEAD_S if first else 0.0)
        keys = [self.keys.hints(shard), self.keys.hint_order(shard), self.keys.done(shard, uid), self.keys.hint_audio(shard, uid)]
        head = pack_hint_head(hint)

        async def offer_from(sample: int) -> int:  # the audio from `sample` on
            return await self._offer(keys=keys, args=[uid, head, repr(score), int(speculative), HINTS_MAX, 2 * sample,
                                                      pcm16(hint.audio[sample:]), HINT_AUDIO_TTL_S])

        reply = await offer_from(min(self._hint_audio.pop(uid, 0), hint.audio.size))  # what Redis holds, as far as we know
        if reply == -1:  # its audio expired in Redis meanwhile: all of it again
            reply = await offer_from(0)
        if reply in (1, 2):
            self._hint_audio[uid] = hint.audio.size
            while len(self._hint_audio) > HINT_AUDIO_REMEMBERED:
                self._hint_audio.pop(next(iter(self._hint_audio)))

    async def speculation(self, utterance_id: str) -> Speculation | None:
        return (await self.speculations([utterance_id])).get(utterance_id)

    async def depth(self) -> int:
        """Jobs not yet published: waiting plus being transcribed."""
        if self.keys.shards == 1:
            return int(await self.redis.xlen(self.keys.jobs(0)))
        async with self.redis.pipeline() as pipe:
            for shard in range(self.keys.shards):
                pipe.xlen(self.keys.jobs(shard))
            return sum(int(n) for n in await pipe.execute())

    async def backlog(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for shard in range(self.keys.shards):  # a room's count is on its own shard only
            counts = await self.redis.hgetall(self.keys.backlog(shard))
            out.update({k.decode()[2:]: int(v) for k, v in counts.items() if k.startswith(b"r:") and int(v) > 0})
        return out

    async def _live_stats(self, gateways: bool = False) -> list[dict[str, Any]]:
        """The heartbeat stats of the live workers (or gateways). Alive = its heartbeat key exists:
        Redis's clock decides, so hosts whose clocks disagree do not hide workers. A gateway
        found gone is taken out of its table (a worker's stats stay: claims look for its jobs)."""
        table = self.keys.gateways() if gateways else self.keys.workers()
        alive = self.keys.gateway_alive if gateways else self.keys.alive
        stats = await self.redis.hgetall(table)
        names = [name.decode() if isinstance(name, bytes) else name for name in stats]
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.exists(alive(name))
            found = await pipe.execute() if names else []
        if gateways and (gone := [n for n, is_alive in zip(names, found) if not is_alive]):
            await self.redis.hdel(table, *gone)
        return [json.loads(value) for value, is_alive in zip(stats.values(), found) if is_alive]

    async def capacity(self) -> tuple[int, float]:
        """Live workers and their summed capacity (utterances/s; their recent throughput where a
        worker reports no capacity)."""
        live = await self._live_stats()
        return len(live), sum(float(s.get("capacity", s.get("utt_per_s", 0.0))) for s in live)

    async def gateway_beat(self, gateway: str, stats: dict[str, Any]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.gateway_alive(gateway), b"1", px=int(GATEWAY_ALIVE_TTL_S * 1000))
            pipe.hset(self.keys.gateways(), gateway, json.dumps(stats))
            await pipe.execute()

    async def fleet_load(self) -> tuple[int, float, float, int]:
        gateways = await self._live_stats(gateways=True)
        workers, capacity = await self.capacity()
        return (sum(int(g.get("students", 0)) for g in gateways), sum(float(g.get("utt_per_s", 0.0)) for g in gateways),
                capacity, workers)

    async def hints_wanted(self) -> HintWish:
        return wanted_hints(await self._live_stats())

    async def is_done(self, utterance_id: str) -> bool:
        """A worker (or a claim) has published this utterance."""
        return bool(await self.done_of([utterance_id]))

    async def done_of(self, utterance_ids: list[str]) -> set[str]:
        """Those of the utterances that are published (or found to be copies of published ones)."""
        if not utterance_ids:
            return set()
        asked = [(uid, shard) for uid in utterance_ids for shard in self._shards_of(uid)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for uid, shard in asked:
                pipe.exists(self.keys.done(shard, uid))
            found = await pipe.execute()
        return {uid for (uid, _shard), hit in zip(asked, found) if hit}

    async def sent_spans(self, room_id: str, spoken: str) -> list[tuple[float, float]]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrange(self.keys.sent(room_id, spoken), 0, -1)
            pipe.zrange(self.keys.spoken(room_id, spoken), 0, -1)  # published without a job: a fallback's claim
            members = [m for found in await pipe.execute() for m in found]
        spans = []
        for member in members:
            start, end = member.decode().split(",")[:2]
            spans.append((float(start), float(end)))
        return spans

    keeps_spoken = True  # Redis keeps the spoken record (spoken_key) through restarts of anyone

    def remember_spoken(self, room_id: str, spoken: str, spans: list[tuple[float, float, bool]]) -> None:
        """Nothing to do: keeps_spoken."""

    async def _publish_after(self, room_id: str, event_json: str, reply: Any, token: str) -> bool:
        """A script's reply (publication.py): whether its result was the first; on a replicated
        Redis the result is published here, now that a replica holds its done key."""
        if not token:
            return bool(reply)
        if int(reply) == 0 or token in self._published:  # 2 after a publication: a second call, not a retry
            return False
        await self.redis.publish(self.keys.room_channel(room_id), event_json)
        self._published[token] = None
        if len(self._published) > ROOMS_REMEMBERED:
            self._published.popitem(last=False)
        return True

    async def claim(self, event: TranscriptEvent) -> bool:
        """Publish a result made outside the workers unless the utterance was published already
        (True: this one is the room's)."""
        self._hint_audio.pop(event.utterance_id, None)  # the script deletes its hint audio
        shard = self._note(event.utterance_id, event.room_id)
        keys = [self.keys.done(shard, event.utterance_id), self.keys.history(event.room_id), self.keys.transcript(event.room_id),
                self.keys.spoken(event.room_id, spoken_of(event.student_id, event.stream_clock)),
                self.keys.hint_audio(shard, event.utterance_id)]
        event_json = event.to_json()
        args = [self.keys.room_channel(event.room_id), event_json, self.history_len, int(DONE_TTL_S), HISTORY_FIELD,
                int(is_final_transcript(event_json)), self.transcript_retention_s, *span_args(event)]
        reply, token = await self._replicated(self._claim, keys, args, f"claim:{uuid.uuid4().hex}")
        return await self._publish_after(event.room_id, event_json, reply, token)

    # ---- worker side ----

    async def ensure_group(self) -> None:
        """Create the group (and the stream) once; after a Redis restart without its data too."""
        for shard in range(self.keys.shards):
            await self._ensure_group(shard)
        self._group_ready = True

    async def _ensure_group(self, shard: int) -> None:
        try:
            await self.redis.xgroup_create(self.keys.jobs(shard), JOB_GROUP, id="0", mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    async def read(self, count: int, block_ms: int) -> list[Entry]:
        """New jobs for this worker (waits up to block_ms for the first; on a cluster up to
        LIVELY_WAIT_MS when block_ms is shorter, for a stream that is slow to answer)."""
        assert self.worker, "a worker name is needed to read"
        if self.keys.shards == 1:
            return await self._read_shard(0, count, block_ms)
        self._collect()
        if len(self._unread) < count:
            await self._read_shards(count, block_ms if not self._unread else 0)
        out, self._unread = self._unread[:count], self._unread[count:]
        return out

    async def _read_shards(self, count: int, block_ms: int) -> None:
        """Every shard's stream is read by a task of its own, blocking there (XREADGROUP cannot
        read streams of several slots at once); what the first to answer read is handed out, and
        a read still blocked on a quiet stream goes on into the next call. Each blocks
        SHARD_BLOCK_MS whatever the call's block_ms (this call waits block_ms at most): a
        worker that looks for hints between reads calls every 20 ms, and a read per shard each
        time was a dozen Redis calls every 20 ms of an idle worker.
        A stream whose last read brought jobs has no read blocked on it while the worker
        recognises them; what reached it meanwhile is read at once, without blocking, before
        anything waits: otherwise a batch held only each stream's first job of the last batch's
        time and the rest waited a batch longer. Those reads are waited for LIVELY_WAIT_MS at
        most (or block_ms): a primary that hangs or fails over holds up its own streams, not the
        jobs already read from the others; its read is collected by a later call."""
        lively = [self._start_read(shard, count - len(self._unread), 0)
                  for shard in self._lively if shard not in self._readers]
        self._block_on_the_rest(count)
        if lively:
            await asyncio.wait(lively, timeout=max(block_ms, LIVELY_WAIT_MS) / 1000)
            self._collect()
            self._block_on_the_rest(count)  # the lively streams that had nothing more
            if self._unread:
                return
        await asyncio.wait(self._readers.values(), timeout=block_ms / 1000, return_when=asyncio.FIRST_COMPLETED)
        self._collect()

    def _block_on_the_rest(self, count: int) -> None:
        for shard in range(self.keys.shards):
            if shard not in self._readers:
                self._start_read(shard, count, SHARD_BLOCK_MS)

    def _start_read(self, shard: int, count: int, block_ms: int) -> asyncio.Task[list[Entry]]:
        task = self._readers[shard] = asyncio.get_running_loop().create_task(self._read_shard(shard, count, block_ms))
        return task

    def _collect(self) -> None:
        """The answered reads' jobs into _unread; a failed read raised when nothing was read."""
        failure: BaseException | None = None
        for shard, task in list(self._readers.items()):
            if not task.done():
                continue
            del self._readers[shard]
            if task.cancelled():
                self._lively.discard(shard)
                continue
            if (error := task.exception()) is not None:
                self._lively.discard(shard)  # read again by a blocked read, not at once by every call
                failure = error
                continue
            entries = task.result()
            self._unread += entries
            if entries:
                self._lively.add(shard)
            else:
                self._lively.discard(shard)
        if failure is not None and not self._unread:
            raise failure

    async def _read_shard(self, shard: int, count: int, block_ms: int) -> list[Entry]:
        stream = self.keys.jobs(shard)
        try:
            reply = await self.redis.xreadgroup(JOB_GROUP, self.worker, {stream: ">"}, count=count,
                                              block=block_ms if block_ms > 0 else None)  # BLOCK 0 would wait for ever
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            await self._ensure_group(shard)  # Redis restarted empty, or a failover lost the group
            return []
        return await self._decode(shard, [(eid, fields) for _stream, entries in reply or [] for eid, fields in entries])

    async def take_hints(self, count: int, partials: bool = True) -> list[Utterance]:
        packed: list[bytes] = []
        shards = [(self._next_hint_shard + i) % self.keys.shards for i in range(self.keys.shards)]
        if len(shards) > 1:
            # Those holding hints, found in one pipeline: a worker asks before every batch, and a
            # script call per shard, one after the other, held each batch a dozen round trips.
            async with self.redis.pipeline(transaction=False) as pipe:
                for shard in shards:
                    if partials:
                        pipe.zcard(self.keys.hint_order(shard))
                    else:
                        pipe.zcount(self.keys.hint_order(shard), "-inf", "(0")
                held = await pipe.execute()
            shards = [shard for shard, n in zip(shards, held) if int(n) > 0]
        # Shards in turn from where the last call stopped, until `count` are taken.
        for shard in shards:
            packed += await self._take_hints(keys=[self.keys.hints(shard), self.keys.hint_order(shard)],
                                             args=[count - len(packed) // 2, int(partials), self.keys.done(shard, ""),
                                                   self.keys.hint_audio(shard, "")])
            if len(packed) // 2 >= count:
                self._next_hint_shard = (shard + 1) % self.keys.shards
                break
        out = []
        for head, pcm in zip(packed[::2], packed[1::2]):
            try:
                hint = unpack_hint(head, pcm)
            except JobError as error:
                log.error("dropping a hint: %s", error)
                continue
            self._note(hint.utterance_id, hint.room_id)
            if now() - hint.end_of_speech_ts <= HINT_MAX_AGE_S:  # older: its gateway or student went away
                out.append(hint)
        return out

    async def keep_speculations(self, speculations: dict[str, Speculation]) -> None:
        if not speculations:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for utterance_id, speculation in speculations.items():
                for shard in self._shards_of(utterance_id):
                    pipe.set(self.keys.speculation(shard, utterance_id), speculation.to_json(), ex=int(SPECULATION_TTL_S))
            await pipe.execute()

    async def speculations(self, utterance_ids: list[str]) -> dict[str, Speculation]:
        if not utterance_ids:
            return {}
        asked = [(uid, shard) for uid in utterance_ids for shard in self._shards_of(uid)]
        if self.keys.shards == 1:
            values = await self.redis.mget([self.keys.speculation(0, uid) for uid in utterance_ids])
        else:  # MGET takes the keys of one slot only
            async with self.redis.pipeline() as pipe:
                for uid, shard in asked:
                    pipe.get(self.keys.speculation(shard, uid))
                values = await pipe.execute()
        return {uid: Speculation.from_json(v) for (uid, _shard), v in zip(asked, values) if v}

    async def publish_partial(self, event: TranscriptPartialEvent) -> bool:
        shard = self._note(event.utterance_id, event.room_id)
        return bool(await self._partial(keys=[self.keys.done(shard, event.utterance_id)],
                                        args=[self.keys.room_channel(event.room_id), event.to_json()]))

    async def publish_event(self, event: Event) -> bool:
        await self._publish_many(keys=[self.keys.history(event.room_id), self.keys.transcript(event.room_id)],
                                 args=[self.keys.room_channel(event.room_id), self.history_len, HISTORY_FIELD,
                                       self.transcript_retention_s, event.to_json(), int(event.kept), 0])
        return True

    async def heartbeat(self, stats: dict[str, Any]) -> None:
        assert self.worker
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.alive(self.worker), b"1", px=int(ALIVE_TTL_S * 1000))
            pipe.hset(self.keys.workers(), self.worker, json.dumps({**stats, "ts": time.time()}))
            await pipe.execute()

    async def _connected_workers(self) -> set[str] | None:
        """The client names of the connections open to Redis now, or None where CLIENT LIST is not
        allowed (a managed Redis, an ACL user without it, a cluster): then only heartbeats tell."""
        if not self._client_list_allowed:
            return None
        try:
            clients = await self.redis.client_list(_type="normal")
        except ResponseError as error:
            log.info("CLIENT LIST refused (%s): dead workers are found by their heartbeat only", error)
            self._client_list_allowed = False
            return None
        return {c.get("name", "") for c in clients}

    async def claim_orphans(self, count: int = 256) -> list[Entry]:
        assert self.worker
        # The shards side by side (one after the other, a cluster's 12 took two dozen round trips),
        # each worker's heartbeat looked up once for all of them.
        alive: dict[str, asyncio.Task[int]] = {}
        found = await asyncio.gather(*(self._claim_orphans(shard, count, alive) for shard in range(self.keys.shards)))
        return [entry for entries in found for entry in entries]

    async def _claim_orphans(self, shard: int, count: int, alive: dict[str, asyncio.Task[int]]) -> list[Entry]:
        assert self.worker
        stream = self.keys.jobs(shard)
        claimed: list[tuple[bytes, dict]] = []
        try:
            consumers = await self.redis.xinfo_consumers(stream, JOB_GROUP)
        except ResponseError as error:
            if "NOGROUP" not in str(error) and "no such key" not in str(error):
                raise
            await self._ensure_group(shard)
            return []
        connected = await self._connected_workers() if any(int(c["pending"]) for c in consumers) else None
        for consumer in consumers:
            name = consumer["name"].decode() if isinstance(consumer["name"], bytes) else consumer["name"]
            if name == self.worker:
                continue
            if int(consumer["pending"]) == 0 and int(consumer.get("idle", 0)) < FORGET_IDLE_MS:
                continue  # nothing to claim, not to be forgotten yet: whether it lives does not matter
            # Dead: its heartbeat expired, or its process is gone (no connection left).
            gone = connected is not None and worker_client_name(name) not in connected
            if not gone:
                if name not in alive:
                    alive[name] = asyncio.ensure_future(self.redis.exists(self.keys.alive(name)))
                if await asyncio.shield(alive[name]):
                    continue
            if int(consumer["pending"]) == 0:
                # Forget a consumer only once it has been idle a long while: one that is just
                # starting (or whose beat lapsed briefly) may be reading right now, and deleting
                # a consumer throws away its pending jobs.
                if int(consumer.get("idle", 0)) >= FORGET_IDLE_MS:
                    await self.redis.xgroup_delconsumer(stream, JOB_GROUP, name)
                    if shard == self.keys.shards - 1:  # its stats go once no stream knows it
                        await self.redis.hdel(self.keys.workers(), name)
                continue
            pending = await self.redis.xpending_range(stream, JOB_GROUP, "-", "+", count, consumername=name)
            ids = [p["message_id"] for p in pending]
            if ids:
                got = await self.redis.xclaim(stream, JOB_GROUP, self.worker, CLAIM_MIN_IDLE_MS, ids)
                claimed += [(eid, fields) for eid, fields in got if fields]
                log.warning("claimed %d jobs of worker %s (%s)", len(got), name,
                            "its connections closed" if gone else "no heartbeat")
        # Jobs idle past the visibility timeout (a worker alive but stuck): looked for a tenth of
        # the timeout apart, not at every call (a worker calls four times a second).
        if time.monotonic() - self._autoclaimed.get(shard, -1e9) >= self.visibility_ms / 10_000:
            self._autoclaimed[shard] = time.monotonic()
            _next, stale, *_ = await self.redis.xautoclaim(stream, JOB_GROUP, self.worker, self.visibility_ms, "0-0", count=count)
            claimed += [(eid, fields) for eid, fields in stale if fields]
        return await self._decode(shard, claimed)

    async def complete(self, entry_id: str, u: Utterance, event: TranscriptEvent) -> bool:
        shard, stream_id = self._stream_id(entry_id)
        keys = [self.keys.done(shard, u.utterance_id), self.keys.history(u.room_id), self.keys.jobs(shard),
                self.keys.backlog(shard), self.keys.transcript(u.room_id),
                self.keys.spoken(u.room_id, spoken_of(event.student_id, event.stream_clock)),
                self.keys.hint_audio(shard, u.utterance_id), self.keys.room_jobs(u.room_id), self.keys.shares(u.room_id)]
        event_json = event.to_json()
        args = [self.keys.room_channel(u.room_id), event_json, self.history_len, JOB_GROUP, stream_id, int(DONE_TTL_S),
                HISTORY_FIELD, *backlog_fields(u.room_id, u.student_id), int(is_final_transcript(event_json)),
                self.transcript_retention_s, *span_args(event), u.source, _place(u)]
        reply, token = await self._replicated(self._complete, keys, args, f"{self.worker}/{entry_id}")
        return await self._publish_after(u.room_id, event_json, reply, token)

    async def complete_many(self, done: list[tuple[str, Utterance, TranscriptEvent]]) -> list[bool | None]:
        """complete() of a batch's jobs: one script call per shard (its jobs in the order given,
        so one student's in the order spoken), one round trip per primary, and on a replicated
        Redis the fresh results published in one pipeline once their replicas confirm. A reply per
        job: whether its result was the first, or None where its shard could not be reached
        (nothing of it relied on: the caller completes it again, which publishes it once)."""
        by_shard: dict[int, list[int]] = {}
        calls: list[tuple[list[Any], list[Any]]] = []
        for i, (entry_id, _u, _event) in enumerate(done):
            by_shard.setdefault(self._stream_id(entry_id)[0], []).append(i)
        jsons = [event.to_json() for _, _, event in done]
        tokens = [f"{self.worker}/{entry_id}" if self.replication.enabled else "" for entry_id, _, _ in done]
        shards = list(by_shard.items())
        for shard, indexes in shards:
            keys: list[Any] = []
            args: list[Any] = []
            for i in indexes:
                entry_id, u, event = done[i]
                _, stream_id = self._stream_id(entry_id)
                keys += [self.keys.done(shard, u.utterance_id), self.keys.history(u.room_id), self.keys.jobs(shard),
                         self.keys.backlog(shard), self.keys.transcript(u.room_id),
                         self.keys.spoken(u.room_id, spoken_of(event.student_id, event.stream_clock)),
                         self.keys.hint_audio(shard, u.utterance_id), self.keys.room_jobs(u.room_id), self.keys.shares(u.room_id)]
                args += [self.keys.room_channel(u.room_id), jsons[i], self.history_len, JOB_GROUP, stream_id, int(DONE_TTL_S),
                         HISTORY_FIELD, *backlog_fields(u.room_id, u.student_id), int(is_final_transcript(jsons[i])),
                         self.transcript_retention_s, *span_args(event), u.source, _place(u), tokens[i]]
            calls.append((keys, args))
        out: list[bool | None] = [None] * len(done)
        replies = await self.replication.run_many(self._complete_many, calls)
        failure: BaseException | None = None
        for (_shard, indexes), reply in zip(shards, replies):
            if isinstance(reply, BaseException):
                failure = reply
                continue
            for i, fresh in zip(indexes, reply):
                out[i] = bool(fresh) if not tokens[i] else int(fresh) != 0 and tokens[i] not in self._published
        if failure is not None:
            log.warning("completions not written (%s): they are written again", failure)
        publish = [i for i, fresh in enumerate(out) if fresh and tokens[i]]
        if publish:  # on a replicated Redis: now that a replica holds the done keys (_publish_after)
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for i in publish:
                        channel = self.keys.room_channel(done[i][1].room_id)
                        if not is_cluster(self.redis):
                            pipe.publish(channel, jsons[i])
                        else:  # a cluster pipeline takes PUBLISH only addressed (any node carries it to all)
                            pipe.execute_command("PUBLISH", channel, jsons[i], target_nodes=self.redis.get_node_from_key(channel))
                    await pipe.execute()
            except UNREACHABLE_ERRORS as error:
                log.warning("results not published (%s): they are published again", error)
                for i in publish:
                    out[i] = None  # written: completed again, the script answers 2 and they are published
                return out
            for i in publish:
                self._published[tokens[i]] = None
            while len(self._published) > ROOMS_REMEMBERED:
                self._published.popitem(last=False)
        return out

    async def attempt(self, entry_id: str) -> int:
        shard, _ = self._stream_id(entry_id)
        key = self.keys.attempts(shard, entry_id)
        async with self.redis.pipeline(transaction=not is_cluster(self.redis)) as pipe:
            pipe.incr(key)
            pipe.expire(key, int(DONE_TTL_S))
            count, _ = await pipe.execute()
        return int(count)

    async def drop(self, entry_id: str) -> None:
        shard, stream_id = self._stream_id(entry_id)
        await self.redis.xack(self.keys.jobs(shard), JOB_GROUP, stream_id)
        await self.redis.xdel(self.keys.jobs(shard), stream_id)

    async def _decode(self, shard: int, raw: list[tuple[bytes, dict]]) -> list[Entry]:
        out: list[Entry] = []
        for eid, fields in raw:
            entry_id = self._entry_id(shard, eid.decode() if isinstance(eid, bytes) else eid)
            try:
                u = decode_job(fields)
            except JobError as error:  # written by something else: never retried
                log.error("dropping stream entry %s: %s", entry_id, error)
                await self.drop(entry_id)
                continue
            self._note(u.utterance_id, u.room_id)
            out.append((entry_id, u))
        return out
