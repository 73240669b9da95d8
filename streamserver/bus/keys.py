"""The Redis key layout, in one place: the bus, the job queue and their Lua scripts get every key
name from here (scripts take them as KEYS/ARGV, never spell them).

Rooms
  room:<id>               pub/sub channel of the room's events
  room:<id>:history       capped stream of the same events (field HISTORY_FIELD), for replay
  room:<id>:transcript    list of the room's final transcripts (event JSON), the whole class,
                          expiring TRANSCRIPT_RETENTION_S after its last one
  room:<id>:meta          hash: name, language, max_students (any gateway can adopt the room)
  room:<id>:seats         sorted set student -> end of its longest seat lease (Redis clock, ms)
  room:<id>:seat_leases   hash student -> JSON {holder: lease end}
  room:<id>:seat_names    hash student -> display name, while seated (the dashboard's roster)
Recognition jobs
  asr:jobs                stream of utterance jobs (consumer group JOB_GROUP); an entry is deleted
                          once its result is published, so XLEN is the backlog
  asr:alive:<worker>      a worker's heartbeat, expiring shortly after its last beat
  asr:workers             hash worker -> JSON stats (throughput, capacity, last beat) for backpressure
  asr:gateway:<gateway>   a gateway's heartbeat, expiring shortly after its last beat
  asr:gateways            hash gateway -> JSON {students, utt_per_s}: the fleet's load (capacity.py)
  asr:done:<utterance>    set by the publication itself: at most one result per utterance
  asr:attempts:<entry>    failed recognitions of a job
  asr:backlog             hash of jobs not yet published: r:<room> and s:<room>:<student> -> count
                          (the queue's per-room and per-student bounds)
  asr:shares:<room>       sorted set source -> the room's jobs not yet published that it holds
                          (Utterance.source: whose share of the room's queue, queue/fair.py)
  asr:room_jobs:<room>    list of the room's jobs not yet published, oldest first: "<stream id>
                          <JSON place>" (redis_queue.py): the one that gives way at the room's bound
Hints (best effort, lost with Redis: neither logged to its append-only file nor replicated)
  asr:hints               hash utterance -> its newest hint, without its audio (queue/jobs.py
                          pack_hint_head)
  asr:hintpcm:<utterance> the utterance's audio so far (PCM16) for its hints: each hint appends
                          only what the last one did not hold (queue/redis_queue.py)
  asr:hint_order          sorted set utterance -> when offered (epoch s; speculative ones minus
                          SPECULATIVE_FIRST, so that they come first; an utterance's first
                          caption minus FIRST_CAPTION_AHEAD_S, so that it goes before revisions)
  asr:spec:<utterance>    a speculative result waiting for its final (queue/base.py Speculation)

On a Redis Cluster (KeyLayout with CLUSTER_SHARDS shards, docs/redis.md) every key above but the
fleet's (asr:workers, asr:gateways, the heartbeats) is prefixed by its shard's hash tag,
`{<tag>}:`: a room belongs to one shard (room_shard), and its keys, its jobs' stream, backlog,
hints, done keys and spoken records all hash to that shard's one slot, so that each Lua script
touches one slot. The shards' slots are spread evenly over the 16,384, so that a cluster whose
primaries split the slots evenly holds rooms on every primary.
"""

from __future__ import annotations

import zlib

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from streamserver.events import TranscriptEvent, event_type

HISTORY_FIELD = "event"
TRANSCRIPT_RETENTION_S = 30 * 24 * 3600  # how long a class transcript is kept after its last final
JOBS = "asr:jobs"
JOB_GROUP = "asr"
WORKERS = "asr:workers"
GATEWAYS = "asr:gateways"
BACKLOG = "asr:backlog"
HINTS = "asr:hints"
HINT_ORDER = "asr:hint_order"
SPECULATIVE_FIRST = 1e10  # seconds: subtracted from a speculative hint's score
# Seconds subtracted from the score of an utterance's first hint: when captions are more than the
# workers take, a student who has just begun to speak gets a caption before those who have one
# get their next (a revision waits one turn longer instead). HINT_MAX_AGE_S: no revision in line
# is older.
FIRST_CAPTION_AHEAD_S = 5.0


def hint_audio_key(utterance_id: str) -> str:
    return f"asr:hintpcm:{utterance_id}"


def speculation_key(utterance_id: str) -> str:
    return f"asr:spec:{utterance_id}"


def room_channel(room_id: str) -> str:
    return f"room:{room_id}"


def history_key(room_id: str) -> str:
    return f"room:{room_id}:history"


def transcript_key(room_id: str) -> str:
    return f"room:{room_id}:transcript"


def is_final_transcript(event_json: str) -> bool:
    """A `transcript` event: the one kind a room's transcript list keeps (every publish asks)."""
    return event_type(event_json) == TranscriptEvent.type


def meta_key(room_id: str) -> str:
    return f"room:{room_id}:meta"


def seat_keys(room_id: str) -> list[str]:
    return [f"room:{room_id}:seats", f"room:{room_id}:seat_leases", f"room:{room_id}:seat_names"]


def alive_key(worker: str) -> str:
    return f"asr:alive:{worker}"


def gateway_alive_key(gateway: str) -> str:
    return f"asr:gateway:{gateway}"


def spoken_key(room_id: str, student_id: str) -> str:
    """Where a student's published utterances lie on its own clock (a sorted set): a recovered
    utterance (sent again after a break) that one of them covers is not published twice."""
    return f"room:{room_id}:spoken:{student_id}"


def sent_key(room_id: str, spoken: str) -> str:
    """Where a student clock's queued utterances lie on it (a sorted set): audio the page sends
    again that one of them holds is not recognised a second time (audio/sent_again.py)."""
    return f"room:{room_id}:sent:{spoken}"


def done_key(utterance_id: str) -> str:
    return f"asr:done:{utterance_id}"


def attempts_key(entry_id: str) -> str:
    return f"asr:attempts:{entry_id}"


def shares_key(room_id: str) -> str:
    return f"asr:shares:{room_id}"


def room_jobs_key(room_id: str) -> str:
    return f"asr:room_jobs:{room_id}"


def backlog_fields(room_id: str, student_id: str) -> tuple[str, str]:
    return f"r:{room_id}", f"s:{room_id}:{student_id}"


CLUSTER_SHARDS = 12  # job streams (and room groups) of a Redis Cluster: a few for each primary of a 3-primary one


def shard_tags(shards: int) -> list[str]:
    """One hash tag per shard, the k-th hashing into the k-th of `shards` equal slot ranges."""
    tags = []
    for k in range(shards):
        low, high = k * REDIS_CLUSTER_HASH_SLOTS // shards, (k + 1) * REDIS_CLUSTER_HASH_SLOTS // shards
        j = 0
        while not low <= key_slot(f"s{k}-{j}".encode()) < high:
            j += 1
        tags.append(f"s{k}-{j}")
    return tags


class KeyLayout:
    """The key names of one deployment. With one shard (a single Redis, or one that Sentinels
    manage) they are the module's names above, unchanged; with more (a Redis Cluster) each but
    the fleet's carries its shard's hash tag. Every process of a deployment must use the same
    number of shards: a room's shard is a pure function of its id. A prefix (--redis-prefix)
    comes before every name (after a hash tag), so that deployments can share one Redis."""

    def __init__(self, shards: int = 1, prefix: str = "") -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"a Redis key prefix holds no braces (they would make it a hash tag): {prefix!r}")
        self.shards, self.prefix = shards, prefix
        self.tags = [prefix] if shards == 1 else [f"{{{tag}}}:{prefix}" for tag in shard_tags(shards)]

    def shard(self, room_id: str) -> int:
        return zlib.crc32(room_id.encode()) % self.shards if self.shards > 1 else 0

    def tag(self, room_id: str) -> str:
        return self.tags[self.shard(room_id)]

    # ---- the fleet's (no hash tag: plain commands, anywhere in a cluster) ----
    def workers(self) -> str:
        return self.prefix + WORKERS

    def gateways(self) -> str:
        return self.prefix + GATEWAYS

    def alive(self, worker: str) -> str:
        return self.prefix + alive_key(worker)

    def gateway_alive(self, gateway: str) -> str:
        return self.prefix + gateway_alive_key(gateway)

    # ---- per shard ----
    def jobs(self, shard: int) -> str:
        return self.tags[shard] + JOBS

    def backlog(self, shard: int) -> str:
        return self.tags[shard] + BACKLOG

    def hints(self, shard: int) -> str:
        return self.tags[shard] + HINTS

    def hint_order(self, shard: int) -> str:
        return self.tags[shard] + HINT_ORDER

    def attempts(self, shard: int, entry_id: str) -> str:
        return self.tags[shard] + attempts_key(entry_id)

    # ---- per room, and per utterance of a room ----
    def room_channel(self, room_id: str) -> str:
        return self.tag(room_id) + room_channel(room_id)

    def history(self, room_id: str) -> str:
        return self.tag(room_id) + history_key(room_id)

    def transcript(self, room_id: str) -> str:
        return self.tag(room_id) + transcript_key(room_id)

    def meta(self, room_id: str) -> str:
        return self.tag(room_id) + meta_key(room_id)

    def seats(self, room_id: str) -> list[str]:
        return [self.tag(room_id) + key for key in seat_keys(room_id)]

    def spoken(self, room_id: str, spoken: str) -> str:
        return self.tag(room_id) + spoken_key(room_id, spoken)

    def sent(self, room_id: str, spoken: str) -> str:
        return self.tag(room_id) + sent_key(room_id, spoken)

    def shares(self, room_id: str) -> str:
        return self.tag(room_id) + shares_key(room_id)

    def room_jobs(self, room_id: str) -> str:
        return self.tag(room_id) + room_jobs_key(room_id)

    def done(self, shard: int, utterance_id: str) -> str:
        return self.tags[shard] + done_key(utterance_id)

    def hint_audio(self, shard: int, utterance_id: str) -> str:
        return self.tags[shard] + hint_audio_key(utterance_id)

    def speculation(self, shard: int, utterance_id: str) -> str:
        return self.tags[shard] + speculation_key(utterance_id)
