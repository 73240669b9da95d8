"""Issue 31: the key layout of a Redis Cluster and the queue and bus on a real one (3 primaries,
3 replicas, started by the test): each script's keys in one slot, rooms spread over every
primary, every job read from its shard's stream and published once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import numpy as np
import pytest
from redis.crc import key_slot

from streamserver.bus import keys as k
from streamserver.bus.connect import ReplicaBehind, parse_replicated, redacted, topology
from streamserver.bus.keys import CLUSTER_SHARDS, KeyLayout
from streamserver.bus.redis import RedisBus
from streamserver.events import TranscriptEvent, Utterance
from streamserver.queue.redis_queue import RedisQueue
from tests.redis_cluster import RedisClusterServers, RedisSentinelServers, cluster_tools_missing
from tests.system_packages import require_system


def test_a_single_redis_keeps_its_key_names():
    layout = KeyLayout(1)
    assert (layout.jobs(0), layout.backlog(0), layout.hints(0), layout.hint_order(0)) == (k.JOBS, k.BACKLOG, k.HINTS, k.HINT_ORDER)
    assert layout.history("r1") == k.history_key("r1") == "room:r1:history"
    assert layout.room_channel("r1") == k.room_channel("r1") and layout.seats("r1") == k.seat_keys("r1")
    assert layout.done(0, "u1") == k.done_key("u1") and layout.hint_audio(0, "u1") == k.hint_audio_key("u1")
    assert layout.spoken("r1", "s:c") == k.spoken_key("r1", "s:c") and layout.sent("r1", "s:c") == k.sent_key("r1", "s:c")


def test_a_rooms_keys_and_its_jobs_share_one_slot_and_shards_spread_evenly():
    layout = KeyLayout(CLUSTER_SHARDS)
    for room in (f"room-{i}" for i in range(50)):
        shard = layout.shard(room)
        names = [layout.jobs(shard), layout.backlog(shard), layout.hints(shard), layout.hint_order(shard), layout.history(room),
                 layout.transcript(room), layout.meta(room), *layout.seats(room), layout.spoken(room, "s:c"),
                 layout.sent(room, "s:c"), layout.done(shard, "u"), layout.hint_audio(shard, "u"), layout.speculation(shard, "u"),
                 layout.attempts(shard, "1-0"), layout.room_channel(room)]
        assert len({key_slot(n.encode()) for n in names}) == 1, names
    # shard i hashes into the i-th twelfth of the slots: four shards in each third
    slots = [key_slot(layout.jobs(s).encode()) for s in range(CLUSTER_SHARDS)]
    assert [slot * CLUSTER_SHARDS // 16384 for slot in slots] == list(range(CLUSTER_SHARDS))
    assert [sum(1 for slot in slots if slot * 3 // 16384 == third) for third in range(3)] == [4, 4, 4]


def test_replicated_urls_are_read_and_redacted():
    address = parse_replicated("rediss+sentinel://app:s3cret@10.0.0.1:26379,10.0.0.2:26380/classroom")
    assert address is not None
    assert (address.topology, address.hosts, address.username, address.password, address.tls, address.master) == (
        "sentinel", (("10.0.0.1", 26379), ("10.0.0.2", 26380)), "app", "s3cret", True, "classroom")
    assert redacted("redis+cluster://app:s3cret@h1:7000,h2:7001") == "redis+cluster://app:***@h1:7000,h2:7001"
    assert topology("redis+cluster://h1:7000") == "cluster" and topology("redis://h:6379/0") == "single"
    for bad in ("redis+sentinel://h:1", "redis+cluster://h", "redis+mesh://h:1"):
        with pytest.raises(ValueError):
            parse_replicated(bad)


@pytest.fixture(scope="module")
def cluster():
    require_system("redis-server (Debian's, with redis-cli)", cluster_tools_missing())
    with RedisClusterServers(primaries=3) as servers:
        yield servers


def test_jobs_of_rooms_on_every_primary_are_read_and_published_once(cluster):
    rooms = [f"c-{uuid.uuid4().hex[:8]}" for _ in range(24)]

    async def scenario() -> tuple[list[dict], dict[str, bool], list[str], int, dict[str, int]]:
        gateway, worker, bus = RedisQueue(cluster.url), RedisQueue(cluster.url, "cluster-worker"), RedisBus(cluster.url)
        got: list[dict] = []
        listeners = []
        try:
            await worker.ensure_group()
            for room in rooms:
                stream = bus.subscribe(room)

                async def listen(stream=stream) -> None:  # noqa: ANN001 - one room's events
                    async with contextlib.aclosing(stream):
                        async for event in stream:
                            got.append(json.loads(event))

                listeners.append(asyncio.create_task(listen()))
            await asyncio.sleep(1.0)
            counted = sum([await bus.subscriber_count(room) for room in rooms])
            utterances = {}
            for i, room in enumerate(rooms):
                u = Utterance(f"u{i:03d}-{uuid.uuid4().hex[:8]}", room, f"s{i}", "S", "en", np.zeros(1600, np.float32), 1.0, 2.0)
                utterances[u.utterance_id] = u
                await gateway.submit(u)
            backlog = await gateway.backlog()
            read: list = []
            while len(read) < len(rooms):
                read += await worker.read(8, 200)
            firsts = {u.utterance_id: await worker.complete(eid, u, TranscriptEvent.of(u, "hi", "en")) for eid, u in read}
            seconds = [await worker.complete(eid, u, TranscriptEvent.of(u, "hi", "en")) for eid, u in read]
            done = await gateway.done_of(list(utterances))
            await asyncio.sleep(1.0)
            assert await gateway.depth() == 0 and await gateway.backlog() == {}
            assert done == set(utterances) and not any(seconds)
            return got, firsts, [eid for eid, _ in read], counted, backlog
        finally:
            for task in listeners:
                task.cancel()
            await asyncio.gather(*listeners, return_exceptions=True)
            await bus.close()
            await gateway.close()
            await worker.close()

    got, firsts, entry_ids, subscribers, backlog = asyncio.run(scenario())
    assert subscribers == len(rooms)  # one subscription a room, counted over every node
    assert backlog == {room: 1 for room in rooms}
    assert all(firsts.values()) and len(firsts) == len(rooms)
    transcripts = [e for e in got if e["type"] == "transcript"]
    assert sorted(e["utterance_id"] for e in transcripts) == sorted(firsts)  # each once
    layout = KeyLayout(CLUSTER_SHARDS)
    shards = {int(eid.partition("@")[2]) for eid in entry_ids}
    assert shards == {layout.shard(room) for room in rooms}
    owners = {cluster.owner(key_slot(layout.jobs(shard).encode())) for shard in shards}
    assert owners == set(cluster.primaries())  # the rooms' jobs lay on every primary


def test_jobs_that_reach_several_streams_during_a_batch_all_come_in_the_next_read(cluster):
    """A worker's read takes what every stream got while it recognised its last batch: each
    stream's blocked read wakes with the first job that reaches it, and the ones behind it are
    read at once too, not a batch later."""
    layout = KeyLayout(CLUSTER_SHARDS)
    rooms: dict[int, str] = {}
    while len(rooms) < 6:
        room = f"b-{uuid.uuid4().hex[:8]}"
        rooms.setdefault(layout.shard(room), room)

    async def scenario() -> tuple[int, list[str], list[str]]:
        gateway, worker = RedisQueue(cluster.url), RedisQueue(cluster.url, f"batch-{uuid.uuid4().hex[:6]}")
        try:
            await worker.ensure_group()
            assert await worker.read(64, 50) == []  # every stream's read now blocks at Redis
            said: list[str] = []
            for turn in range(2):  # each stream's first job wakes its read; the second comes behind it
                for room in rooms.values():
                    u = Utterance(f"u{turn}-{uuid.uuid4().hex[:8]}", room, "s", "S", "en", np.zeros(1600, np.float32), 1.0, 2.0)
                    await gateway.submit(u)
                    said.append(u.utterance_id)
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.2)  # the worker recognising its batch
            read = await worker.read(64, 200)
            first_read = len(read)
            while len(read) < len(said):
                more = await worker.read(64, 200)
                assert more, "a job was never read"
                read += more
            for eid, u in read:
                await worker.complete(eid, u, TranscriptEvent.of(u, "hi", "en"))
            return first_read, said, [u.utterance_id for _, u in read]
        finally:
            await gateway.close()
            await worker.close()

    first_read, said, read = asyncio.run(scenario())
    assert sorted(read) == sorted(said)
    assert first_read == len(said) == 12


def test_a_primary_that_hangs_holds_up_its_own_streams_only(cluster):
    """A stream whose last read brought jobs is read again at once; when its primary does not
    answer (hung, failing over), the jobs already read from the other primaries' streams are
    handed out within LIVELY_WAIT_MS and a blocked read's wake, not after the hung primary's
    pause."""
    from streamserver.queue.redis_queue import LIVELY_WAIT_MS

    layout = KeyLayout(CLUSTER_SHARDS)
    owner = {shard: cluster.owner(key_slot(layout.jobs(shard).encode())) for shard in range(CLUSTER_SHARDS)}
    rooms: dict[int, str] = {}
    while len(rooms) < CLUSTER_SHARDS:
        room = f"h-{uuid.uuid4().hex[:8]}"
        rooms.setdefault(layout.shard(room), room)
    hung_shard = 0
    others = [shard for shard in rooms if owner[shard] != owner[hung_shard]][:2]

    def utterance(room: str) -> Utterance:
        return Utterance(f"u-{uuid.uuid4().hex[:8]}", room, "s", "S", "en", np.zeros(1600, np.float32), 1.0, 2.0)

    async def submit(gateway: RedisQueue, u: Utterance) -> None:
        for attempt in range(5):  # as a gateway does: a write no replica confirmed in time is sent again
            try:
                await gateway.submit(u)
                return
            except ReplicaBehind:
                if attempt == 4:
                    raise

    async def scenario() -> tuple[float, set[str], set[str]]:
        gateway, worker = RedisQueue(cluster.url), RedisQueue(cluster.url, f"hang-{uuid.uuid4().hex[:6]}")
        read: list = []
        try:
            await worker.ensure_group()
            for _ in range(2):
                await submit(gateway, utterance(rooms[hung_shard]))
            while len(read) < 2:  # the hung shard's stream brought jobs: it is read again at once next time
                read += await worker.read(64, 200)
            later = [utterance(rooms[shard]) for shard in others]
            for u in later:
                await submit(gateway, u)
            await asyncio.sleep(0.1)  # their streams' blocked reads wake with them
            await asyncio.to_thread(cluster.node(owner[hung_shard]).ask, "CLIENT", "PAUSE", "1500", "ALL")
            started = time.monotonic()
            got: list = []
            while len(got) < len(later) and time.monotonic() - started < 3:
                got += await worker.read(64, 200)
            took = time.monotonic() - started
            read += got
            await asyncio.sleep(1.5)  # the pause ends
            for eid, u in read:
                await worker.complete(eid, u, TranscriptEvent.of(u, "hi", "en"))
            return took, {u.utterance_id for _, u in got}, {u.utterance_id for u in later}
        finally:
            await gateway.close()
            await worker.close()

    took, got, later = asyncio.run(scenario())
    assert got == later
    assert took < LIVELY_WAIT_MS / 1000 + 0.5, took


def test_a_job_counts_as_queued_only_once_a_replica_holds_it():
    """Sentinels: a submit whose replica is stalled (DEBUG SLEEP) fails, as if Redis were away,
    so that the gateway keeps the utterance and queues it again; once the replica is gone for
    good the primary is written to alone."""
    require_system("redis-server (Debian's, with redis-cli)", cluster_tools_missing())
    with RedisSentinelServers() as servers:
        async def scenario() -> tuple[float, int]:
            queue = RedisQueue(servers.url)
            room = f"r-{uuid.uuid4().hex[:8]}"
            said = [Utterance(f"u{i}-{uuid.uuid4().hex[:8]}", room, "s", "S", "en", np.zeros(1600, np.float32), 1.0, 2.0)
                    for i in range(3)]
            try:
                await queue.submit(said[0])
                stall = asyncio.create_task(asyncio.to_thread(servers.replica.ask, "DEBUG", "SLEEP", "1.5"))
                await asyncio.sleep(0.2)
                with pytest.raises(ReplicaBehind):
                    await queue.submit(said[1])
                await stall
                await queue.submit(said[1])  # confirmed now (its first write is there too: two jobs, one result)
                servers.replica.kill()
                started = time.monotonic()
                await queue.submit(said[2])
                return time.monotonic() - started, await queue.depth()
            finally:
                await queue.close()

        alone_s, depth = asyncio.run(scenario())
    assert alone_s < 2.0  # no replica: one WAIT timeout at most, not a failure
    assert depth == 4


def test_two_deployments_share_one_redis_through_their_prefixes(redis_url):
    """--redis-prefix: every key of a deployment starts with its prefix, and neither sees the
    other's jobs, workers or room events."""
    prefixes = (f"a{uuid.uuid4().hex[:6]}:", f"b{uuid.uuid4().hex[:6]}:")

    async def scenario() -> tuple[list[list[str]], list[int], list[list[str]], set[str]]:
        queues = [RedisQueue(redis_url, prefix=p) for p in prefixes]
        workers = [RedisQueue(redis_url, f"w-{p}", prefix=p) for p in prefixes]
        buses = [RedisBus(redis_url, prefix=p) for p in prefixes]
        try:
            for worker in workers:
                await worker.ensure_group()
                await worker.heartbeat({"utt_per_s": 1.0})
            u = Utterance(f"u-{uuid.uuid4().hex[:8]}", "shared-room", "s", "S", "en", np.zeros(1600, np.float32), 1.0, 2.0)
            await queues[0].submit(u)
            await buses[1].publish("shared-room", json.dumps({"type": "note", "room_id": "shared-room"}))
            read = [[uid for _eid, got in await w.read(4, 100) for uid in [got.utterance_id]] for w in workers]
            live = [(await q.capacity())[0] for q in queues]
            histories = [await bus.history("shared-room") for bus in buses]
            keys = {key.decode() for p in prefixes for key in await queues[0].redis.keys(p + "*")}
            return read, live, histories, keys
        finally:
            for closable in (*queues, *workers, *buses):
                await closable.close()

    read, live, histories, keys = asyncio.run(scenario())
    assert read[0] and not read[1]  # deployment b's worker never sees a's job
    assert live == [1, 1]  # each sees its own worker only
    assert not histories[0] and len(histories[1]) == 1
    assert {key.split(":", 1)[0] + ":" for key in keys} == set(prefixes)
    assert any(key.startswith(prefixes[0] + "asr:jobs") for key in keys) and any("room:shared-room:history" in key for key in keys)
    with pytest.raises(ValueError):
        KeyLayout(1, "{bad}")
