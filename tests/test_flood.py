"""One hostile student link cannot stall a school (issue 12): a real `streamserver serve`, a
flooder on room A's link sending speech as fast as the socket takes it, an honest student in
room B speaking LibriVox clips in real time (benchmarks/flood.py does the driving)."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.flood import run
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
