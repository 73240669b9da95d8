"""The load simulator's WebRTC students (streamserver/loadsim/webrtc_student.py): the packets
client sends its plan as Opus in real time for a fraction of the encoding client's CPU, and the
encoding client, not the server, is what lost the speech of 50 WebRTC students (issue 13)."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import numpy as np
import pytest
from aiortc.codecs.opus import OpusDecoder
from aiortc.jitterbuffer import JitterFrame
from aiortc.mediastreams import MediaStreamError

from streamserver.audio.resample import To16kMono
from streamserver.audio.segmenter import DIGITAL_SILENCE, SegmenterConfig, UtteranceSegmenter
from streamserver.loadsim import students
from streamserver.loadsim.run import LoadConfig, Run
from streamserver.loadsim.scenario import RATE, Turn, load_clips, plan_turns, render
from streamserver.loadsim.webrtc_student import CONSENT_EXPIRED, PACKET_SAMPLES, OpusPlanTrack, PacketClock, encoded_clips, on_consent_expired
from streamserver.loadsim.ws_student import PlayHooks
from tests.server_process import ADMIN_TOKEN, ServerProcess

from tests.takers import PcmTo, SpeechList


class InstantClock(PacketClock):
    """Every packet is due at once: the track's stream without the wall clock."""

    async def wait(self, tick: int) -> None:
        return None


def _segment(pcm: np.ndarray) -> list[tuple[float, float]]:
    """(start, end of speech) of each utterance, on the stream's own time."""
    position = [0]
    found = SpeechList()
    segmenter = UtteranceSegmenter(SegmenterConfig(), found, clock=lambda: position[0] / RATE)
    for i in range(0, pcm.size, 320):
        position[0] = i + 320
        segmenter.feed(pcm[i : i + 320])
    segmenter.flush()
    return [(s.start_ts, s.end_of_speech_ts) for s in found]


def test_plan_track_sends_the_plan_as_opus():
    """A student's whole stream, decoded the way the server decodes it: one packet per 20 ms with
    continuous timestamps, each clip counted once it is all out, the clips' audio intact and
    digital silence between them, and one utterance per clip."""
    clips, rng, counted, drawn = load_clips(), random.Random(3), [], {}

    def planner(length_s: float):
        drawn["length"], drawn["turns"] = length_s, plan_turns(clips, length_s, 0.3, rng)
        return drawn["turns"]

    hooks = PlayHooks(lambda s, _onset: counted.append(("started", s)), lambda s, _text: counted.append(("sent", s)))
    encoded_clips()  # encoded once per process, before the clock starts
    track = OpusPlanTrack(InstantClock(), planner, time.time() + 40, hooks, lead_s=0.5)
    track.student_id = "s1"

    async def play() -> list:
        packets = []
        while True:
            try:
                packets.append(await track.recv())
            except MediaStreamError:
                return packets

    packets = asyncio.run(play())
    turns = track.timetable.turns
    assert len(turns) >= 2 and track.complete and track.finished.is_set() and track.timetable.unsent == 0
    assert len(packets) == track.total == pytest.approx(40 / 0.020, abs=5)
    assert [p.pts for p in packets] == [i * PACKET_SAMPLES for i in range(len(packets))]
    assert counted == [("started", "s1"), ("sent", "s1")] * len(turns)

    decoder, to16k = OpusDecoder(), To16kMono()
    pcm = np.concatenate([to16k.push(f) for p in packets for f in decoder.decode(JitterFrame(bytes(p), p.pts))])
    source = (np.clip(np.concatenate([np.zeros(RATE // 2), render(drawn["turns"], drawn["length"])]), -1, 1) * 32767).astype(np.int16)
    first = turns[0]
    a, b = int(first.start_s * RATE), int(first.end_s * RATE)
    lag = max(range(0, 320), key=lambda k: float(np.dot(pcm[a + k : b + k].astype(float), source[a:b])))  # the codec's delay
    assert lag <= 0.010 * RATE  # Opus's 6.5 ms look-ahead, and the resamplers'
    for turn in turns:  # each clip's audio, as intact as Opus at 32 kbit/s leaves it (0.82-0.95 for these clips)
        a, b = int(turn.start_s * RATE), int(turn.end_s * RATE)
        assert np.corrcoef(pcm[a + lag : b + lag], source[a:b])[0, 1] > 0.75
    gaps = [(int((x.end_s + 0.3) * RATE), int((y.start_s - 0.1) * RATE)) for x, y in zip(turns, turns[1:])]
    assert all(np.abs(pcm[a:b]).max() <= DIGITAL_SILENCE for a, b in gaps)  # silence between the clips
    utterances = _segment(pcm)
    assert len(utterances) == len(turns)
    for (start, end), turn in zip(utterances, turns):  # each utterance lies on its clip
        assert turn.start_s - 0.3 <= start < end <= turn.end_s + 0.1


def test_packet_clock_releases_every_track_on_one_grid_and_reports_lag():
    lags: list[float] = []
    clock = PacketClock(lags.append, packet_s=0.01)

    async def track(done: list[float]) -> None:
        start = clock.now() + 1
        for k in range(20):
            await clock.wait(start + k)
        done.append(time.monotonic())

    async def main() -> tuple[float, list[float]]:
        done: list[float] = []
        t0 = time.monotonic()
        await asyncio.gather(*(track(done) for _ in range(50)))
        elapsed = time.monotonic() - t0
        waiter = asyncio.ensure_future(clock.wait(clock.now() + 2))
        await asyncio.sleep(0)
        time.sleep(0.1)  # the loop is blocked: the clock wakes late and says so
        await waiter
        return elapsed, done

    elapsed, done = asyncio.run(main())
    assert 0.18 <= elapsed < 0.6 and max(done) - min(done) < 0.05  # 20 ticks of 10 ms, all tracks together
    assert lags and max(lags) >= 0.05


def test_consent_expiry_is_counted_and_aioice_stays_quiet(caplog):
    """aioice closes a connection whose consent checks went unanswered six times (~30 s: what a
    server reading its sockets seconds late does to its students) with one INFO line; the
    simulator counts those lines, and lets no other INFO line of aioice through (one per check)."""
    expired: list[int] = []
    on_consent_expired(lambda: expired.append(1))
    log = logging.getLogger("aioice.ice")
    with caplog.at_level(logging.INFO):
        log.info("%s " + CONSENT_EXPIRED, "Connection(3)")
        log.info("%s Check %s State.IN_PROGRESS -> State.SUCCEEDED", "Connection(3)", "pair")
        log.warning("%s something worth a warning", "Connection(3)")
    assert expired == [1]
    assert [r.levelname for r in caplog.records if r.name == "aioice.ice"] == ["WARNING"]


def test_the_packets_client_keeps_real_time_for_80_students(monkeypatch, tmp_path):
    """The cause of issue 13's lost speech, guarded small: 80 WebRTC students in one simulator
    process against `serve` on this machine. aiortc's MediaPlayer client (`--webrtc-client
    encoder`: an encoder per student, one thread pool for all) falls ~10 s behind here and what it
    has not sent at hang-up is never spoken (`benchmarks/webrtc_cost.py --client aiortc` measures
    its cost); the packets client keeps real time and every clip it speaks comes back."""
    monkeypatch.setattr(students, "HANGUP_GRACE_S", 2.0)
    n, duration = 80, 12.0
    with ServerProcess() as server:
        config = LoadConfig(urls=[server.url], students=n, duration_s=duration, admin_token=ADMIN_TOKEN, transport="webrtc",
                            speak_ratio=0.2, drain_s=15.0, webrtc_client="packets", seed=1)
        new = asyncio.run(Run(config, progress=None).run(tmp_path / "packets"))
    assert new["simulator_max_lag_s"] < 0.5 and new["clips_unsent"] == 0, new
    assert new["utterances_sent"] > 0 and new["join_failures"] == 0 and new["disconnects"] == 0
    assert new["lost"] == 0 and new["never_queued"] == 0 and new["lost_vs_queued"] == 0 and new["duplicates"] == 0


def test_fast_rtp_delivers_the_plan_to_the_server_as_aiortcs_sender_would(monkeypatch):
    """A bound track (FastRtp: header packed by the track, aiortc's SRTP session, the ICE pair's
    socket) against the server's receiver: every packet of the plan arrives, in order, and the
    clip's audio is intact; its sender reports (BrowserReports, their interval shortened here)
    reach the server, counting what FastRtp sent; the aiortc and aioice internals it reads are there."""
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

    from streamserver.loadsim import webrtc_student
    from streamserver.transport import rtp_audio, webrtc
    from streamserver.transport.candidates import CandidatePolicy

    monkeypatch.setattr(rtp_audio, "RTCP_INTERVAL_S", 0.3)
    clips = load_clips()
    clip = min(clips, key=lambda c: len(c.pcm))
    got: list[np.ndarray] = []
    plan: dict = {}

    def planner(length_s: float):
        plan["turns"] = [Turn(0.3, clip)]
        plan["length"] = length_s
        return plan["turns"]

    async def body() -> tuple[OpusPlanTrack, dict]:
        webrtc.use_host_addresses(["127.0.0.1"])
        track = OpusPlanTrack(PacketClock(), planner, time.time() + 6, PlayHooks(lambda s, _onset: None, lambda s, _text: None), lead_s=0.5)
        client = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        client.addTrack(track)
        track.bind(client)
        await client.setLocalDescription(await client.createOffer())
        server, answer = await webrtc.answer(client.localDescription.sdp, [], PcmTo(got.append), lambda: None,
                                             CandidatePolicy.of([], ["127.0.0.1"]))
        await client.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        await asyncio.wait_for(track.finished.wait(), 20)
        await asyncio.sleep(0.3)  # the last packets in flight
        sender = client.getTransceivers()[0].sender
        reports = server.getTransceivers()[0].receiver._RTCRtpReceiver__lsr
        assert type(sender) is webrtc_student.BrowserReports and sender.fast is not None and sender.fast.packets > 0
        assert set(reports) == {sender._ssrc} and reports[sender._ssrc] > 0  # the last report's NTP time, as read
        found = {"RTCRtpSender._RTCRtpSender__rtcp_started": sender._RTCRtpSender__rtcp_started.is_set(),
                 "RTCRtpSender._RTCRtpSender__rtcp_exited": hasattr(sender, "_RTCRtpSender__rtcp_exited"),
                 "RTCRtpSender._RTCRtpSender__cname": bool(sender._RTCRtpSender__cname),
                 "RTCRtpSender._send_rtcp": hasattr(sender, "_send_rtcp"),
                 "RTCRtpSender._RTCRtpSender__lsr": hasattr(sender, "_RTCRtpSender__lsr"),
                 "RTCRtpSender._RTCRtpSender__lsr_time": hasattr(sender, "_RTCRtpSender__lsr_time"),
                 "RTCRtpSender._RTCRtpSender__started": sender._RTCRtpSender__started is True,
                 "RTCRtpSender._ssrc": hasattr(sender, "_ssrc"), "RTCRtpSender.transport": sender.transport is not None,
                 "RTCDtlsTransport._tx_srtp": sender.transport._tx_srtp is not None,
                 "RTCIceTransport._connection": hasattr(sender.transport.transport, "_connection"),
                 "RTCRtpTransceiver._codecs": bool(client.getTransceivers()[0]._codecs)}
        pair = sender.transport.transport._connection._nominated.get(1)
        found.update({"Connection._nominated": pair is not None, "CandidatePair.protocol": hasattr(pair, "protocol"),
                      "CandidatePair.remote_addr": hasattr(pair, "remote_addr"),
                      "StunProtocol.transport": getattr(pair.protocol, "transport", None) is not None})
        await client.close()
        await server.close()
        return track, found

    track, found = asyncio.run(asyncio.wait_for(body(), 40))
    assert sorted(found) == sorted(webrtc_student.AIORTC_SENDER_INTERNALS) and all(found.values()), found
    assert track.complete and track.timetable.unsent == 0
    pcm = np.concatenate(got)
    assert abs(pcm.size - track.total * 320) <= 320 * 3  # every 20 ms packet, none lost or doubled
    source = (np.clip(np.concatenate([np.zeros(RATE // 2), render(plan["turns"], plan["length"])]), -1, 1) * 32767).astype(np.int16)
    turn = plan["turns"][0]
    a, b = int(turn.start_s * RATE), int(turn.end_s * RATE)
    lag = max(range(0, 320), key=lambda k: float(np.dot(pcm[a + k : b + k].astype(float), source[a:b])))
    assert np.corrcoef(pcm[a + lag : b + lag], source[a:b])[0, 1] > 0.75


def test_students_offer_from_addresses_of_their_own_on_this_machine():
    """A server counts offers per client address: the simulator's students on one machine join
    from as many loopback addresses as there are students, as a class joins from its homes."""
    from streamserver.loadsim.clients import loopback_source

    sources = {loopback_source("http://127.0.0.1:8000", i) for i in range(10_000)}
    assert len(sources) == 10_000 and all(s.startswith("127.") for s in sources)
    assert loopback_source("https://class.example.org", 3) is None
