"""One hostile student link cannot stall a school (issue 12): a real `streamserver serve`, a
flooder on room A's link sending speech as fast as the socket takes it, an honest student in
room B speaking LibriVox clips in real time (benchmarks/flood.py does the driving)."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.flood import run, run_parallel
from tests.server_process import ADMIN_TOKEN, ServerProcess


@pytest.fixture(scope="module")
def server():
    with ServerProcess() as server:
        yield server


@pytest.mark.parametrize("flood_s", [2.0, 15.0])
def test_a_flooding_link_is_refused_and_the_next_room_keeps_its_latency(server, flood_s):
    result = asyncio.run(run(server.url, ADMIN_TOKEN, server.proc.pid, flood_s))
    flood = result["flood"]
    assert flood["refused_too_fast"] == flood["connections"] == 1
    assert any("real time" in reason for reason in flood["reasons"]), flood["reasons"]
    assert result["honest_transcripts"] == result["honest_clips_spoken"] >= 1  # counted against what was said
    assert result["honest_latency_s"]["max"] <= 3.0, result
    assert result["rss_ratio"] < 1.5, result


def test_a_reconnecting_flooder_still_leaves_the_next_room_its_transcripts(server):
    """The flooder comes back as a new student each time it is refused: each connection gets a
    second of audio, its room's backlog reaches its bound, and room B is served in turn."""
    result = asyncio.run(run(server.url, ADMIN_TOKEN, server.proc.pid, 15.0, reconnect=True))
    assert result["flood"]["connections"] > 10
    assert result["honest_transcripts"] == result["honest_clips_spoken"] >= 3
    # Its latency is a benchmark figure (benchmarks/results/flood-15s-reconnect.json: 2.31 s), not
    # held here: beyond the probe, and in `make test` the two cores are shared with pytest.


@pytest.mark.parametrize("link", ["per-student", "shared"])  # in this order, on one server, as the benchmark
def test_a_hundred_paced_streams_of_one_link_leave_both_rooms_every_utterance(server, link):
    """Issue 33: 100 parallel streams of one link of room A, each at 1.4x real time (under the
    pacing) for 30 s, from one address; a real student speaks in room A and one in room B, each
    from an address of its own. A per-student link seats one student: every stream but the last
    is replaced (4001). The shared link seats the streams as admission plans them (on this 2-core
    box about 100 students at the default planning figure; those past it are answered busy,
    503); their address holds the most of room A's queue, so at the room's bound its
    utterances give way (some of them dropped: the flood did reach the bound), never the real
    student's; room B keeps its speculative finals meanwhile (AsrWorker.busiest_room). Either
    way both real students get every clip transcribed and none dropped, room
    B's mean latency stays within 1.5x of its own before the flood, and the server's memory 10 s
    after the flood is within 1.25x of before it."""
    result = asyncio.run(run_parallel(server.url, ADMIN_TOKEN, server.proc.pid, streams=100, flood_s=30.0, rate=1.4,
                                      link=link))
    if link == "per-student":
        assert result["flood"]["outcomes"] == {"closed 4001": 99, "sent to the end": 1}, result["flood"]
    else:
        assert set(result["flood"]["outcomes"]) <= {"sent to the end", "refused 503"}, result["flood"]
        assert result["room_a"]["flood_dropped"] > 0, result["room_a"]
    for room in ("room_a", "room_b"):
        assert result[room]["transcripts"] == result[room]["clips_spoken"] >= 8 and result[room]["dropped"] == 0, result
    assert result["room_b"]["latency_flood_s"] and result["room_b"]["latency_ratio"] <= 1.5, result["room_b"]
    assert result["rss_after_ratio"] <= 1.25, result
