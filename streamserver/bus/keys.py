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
Hints (best effort, lost with Redis: nothing of them is durable)
  asr:hints               hash utterance -> its newest hint, without its audio (queue/jobs.py
                          pack_hint_head)
  asr:hintpcm:<utterance> the utterance's audio so far (PCM16) for its hints: each hint appends
                          only what the last one did not hold (queue/redis_queue.py)
  asr:hint_order          sorted set utterance -> when offered (epoch s; speculative ones minus
                          SPECULATIVE_FIRST, so that they come first)
  asr:spec:<utterance>    a speculative result waiting for its final (queue/base.py Speculation)
"""

from __future__ import annotations

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
    return [f"room:{room_id}:seats", f"room:{room_id}:seat_leases"]


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


def backlog_fields(room_id: str, student_id: str) -> tuple[str, str]:
    return f"r:{room_id}", f"s:{room_id}:{student_id}"
