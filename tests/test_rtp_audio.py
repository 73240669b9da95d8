"""The server's WebRTC audio receiver (streamserver/transport/rtp_audio.py): what it relies on in
the pinned aiortc, Opus at 16 kHz, the packet timeline (order, loss, duplicates, pauses), and a
real aiortc peer into webrtc.answer: no decoder thread, the stream's end, pacing."""

from __future__ import annotations

import asyncio
import fractions
import inspect
import json
import re
import threading
import time
import tomllib
from pathlib import Path

import aioice
import aioice.ice
import aiortc
import av
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtcdtlstransport import RTCDtlsTransport
from aiortc.rtcicetransport import RTCIceTransport
from aiortc.rtcrtpreceiver import StreamStatistics

from streamserver.audio.pacing import Pacer
from streamserver.audio.resample import To16kMono
from streamserver.transport import rtp_audio, webrtc
from streamserver.transport.candidates import CandidatePolicy
from streamserver.transport.rtp_audio import HOLD, MAX_GAP, OpusDecoder16k, Reorder
from tests.takers import PcmList, PcmTo

ROOT = Path(__file__).resolve().parents[1]
TICKS = 960  # a 20 ms packet on the 48 kHz RTP clock
SAMPLES = 320  # ... at 16 kHz


# --- the aiortc it is built on ------------------------------------------------------------------

def test_aiortc_and_aioice_are_the_pinned_versions():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for module in (aiortc, aioice):
        pinned = next(d for d in deps if d.startswith(module.__name__ + "="))
        assert pinned == f"{module.__name__}=={module.__version__}", "rtp_audio.py relies on their internals: re-check them"


def _parameters(function) -> list[str]:  # noqa: ANN001
    return list(inspect.signature(function).parameters)


def test_the_aiortc_internals_it_relies_on_are_there():
    """A new aiortc that renames or moves any of these breaks the receiver: this fails first."""

    async def body() -> RTCRtpReceiver:
        pc = RTCPeerConnection()
        receiver = pc.addTransceiver("audio", direction="recvonly").receiver
        await pc.close()
        return receiver

    receiver = asyncio.run(body())
    assert type(receiver) is RTCRtpReceiver  # aiortc builds its receivers itself, of this class
    instances = {RTCRtpReceiver: receiver, RTCDtlsTransport: receiver.transport, RTCIceTransport: receiver.transport.transport}
    for cls, name in rtp_audio.AIORTC_INTERNALS:
        assert type(instances[cls]) is cls and hasattr(instances[cls], name), (cls, name)
    assert type(receiver.transport.transport._connection) is aioice.Connection
    assert _parameters(aioice.Connection.data_received) == ["self", "data", "component"]
    assert "self.receiver.data_received(data, self.local_candidate.component)" in inspect.getsource(
        aioice.ice.StunProtocol.datagram_received)
    recv_next = inspect.getsource(RTCDtlsTransport._recv_next)  # what the shortcut does in its place
    assert "data = self._rx_srtp.unprotect(data)" in recv_next and "first_byte > 127 and first_byte < 192" in recv_next
    assert "RtpPacket.parse(data, self._rtp_header_extensions_map)" in inspect.getsource(RTCDtlsTransport._handle_rtp_data)
    # the methods overridden, as aiortc calls them
    assert _parameters(RTCRtpReceiver.receive) == ["self", "parameters"]
    from aiortc.rtcsctptransport import RTCSctpTransport  # webrtc._text_must_decode

    assert _parameters(RTCSctpTransport._data_channel_receive) == ["self", "stream_id", "pp_id", "data"]
    assert "await self._data_channel_receive(stream_id, pp_id, data)" in inspect.getsource(RTCSctpTransport._receive)
    assert "self._data_channels: dict[int, RTCDataChannel] = {}" in inspect.getsource(RTCSctpTransport.__init__)
    assert _parameters(RTCRtpReceiver._handle_rtp_packet) == ["self", "packet", "arrival_time_ms"]
    assert _parameters(RTCRtpReceiver._handle_rtcp_packet) == ["self", "packet"]
    assert _parameters(RTCRtpReceiver._handle_disconnect) == ["self"]
    assert _parameters(RTCRtpReceiver._run_rtcp) == ["self"]
    assert _parameters(RTCRtpReceiver.stop) == ["self"]
    assert "receiver._handle_rtp_packet(packet, arrival_time_ms=" in inspect.getsource(RTCDtlsTransport._handle_rtp_data)
    assert "receiver._handle_disconnect()" in inspect.getsource(RTCDtlsTransport)
    # what receive() does besides starting the thread, and the thread only there
    receive = inspect.getsource(RTCRtpReceiver.receive)
    for step in ("self.__codecs[codec.payloadType] = codec", "self.__transport._register_rtp_receiver(self, parameters)",
                 "self.__rtcp_task = asyncio.ensure_future(self._run_rtcp())", "self.__started = True", "threading.Thread"):
        assert step in receive, step
    assert ".start()" not in inspect.getsource(RTCRtpReceiver.__init__)
    assert "self.__stop_decoder()" in inspect.getsource(RTCRtpReceiver.stop)
    assert _parameters(RTCDtlsTransport._register_rtp_receiver)[:3] == ["self", "receiver", "parameters"]
    assert _parameters(StreamStatistics) == ["clockrate"] and _parameters(StreamStatistics.add) == ["self", "packet"]


# --- Opus at 16 kHz -----------------------------------------------------------------------------

def _encode(pcm16k: np.ndarray, fec: bool = False) -> list[bytes]:
    """20 ms Opus packets of 16 kHz mono int16, encoded at 48 kHz as a browser does."""
    encoder = av.CodecContext.create("libopus", "w")
    encoder.sample_rate, encoder.layout, encoder.format, encoder.bit_rate = 48000, "mono", "s16", 32000
    encoder.options = {"application": "voip", **({"fec": "1", "packet_loss": "10"} if fec else {})}
    encoder.time_base = fractions.Fraction(1, 48000)
    resampler = av.AudioResampler(format="s16", layout="mono", rate=48000, frame_size=960)
    frame = av.AudioFrame.from_ndarray(pcm16k[None].copy(), format="s16", layout="mono")
    frame.sample_rate = 16000
    packets = []
    for i, f in enumerate(resampler.resample(frame)):
        f.pts = i * 960
        packets += [bytes(p) for p in encoder.encode(f)]
    return packets


def _decoded(packets: list[bytes]) -> np.ndarray:
    decoder = OpusDecoder16k()
    return np.concatenate([decoder.decode(p) for p in packets])


@pytest.fixture(scope="module")
def speech(librivox) -> np.ndarray:
    return (np.clip(librivox[1][1], -1, 1) * 32767).astype(np.int16)


@pytest.fixture(scope="module")
def packets(speech) -> list[bytes]:
    return _encode(speech)


def _rtp(csrc: int = 0, extension: bytes | None = None, padding: int = 0, payload: bytes = b"opus-bytes") -> bytes:
    from aiortc.rtp import RtpPacket

    packet = RtpPacket(payload_type=111, sequence_number=65530, timestamp=4_000_000_000, ssrc=0x1234ABCD, payload=payload)
    packet.csrc = list(range(1, csrc + 1))
    data = bytearray(packet.serialize())
    if extension is not None:  # one-byte-header extension block, as browsers send (audio level ...)
        data[0] |= 0x10
        words = (len(extension) + 3) // 4
        block = b"\xbe\xde" + words.to_bytes(2, "big") + extension.ljust(4 * words, b"\0")
        at = 12 + 4 * csrc
        data[at:at] = block
    if padding:
        data[0] |= 0x20
        data += bytes(padding - 1) + bytes([padding])
    return bytes(data)


@pytest.mark.parametrize("shape", [{}, {"csrc": 2}, {"extension": b"\x10\x7f\x22\x00\x01\x02"}, {"padding": 4},
                                   {"csrc": 1, "extension": b"\x10\x05", "padding": 2}])
def test_the_lean_rtp_parse_reads_what_aiortcs_parse_reads(shape):
    from aiortc.rtp import RtpPacket

    data = _rtp(**shape)
    theirs, ours = RtpPacket.parse(data), rtp_audio.parse_rtp(data)
    assert (ours.payload_type, ours.sequence_number, ours.timestamp, ours.ssrc, ours.payload) == (
        theirs.payload_type, theirs.sequence_number, theirs.timestamp, theirs.ssrc, theirs.payload) == (
        111, 65530, 4_000_000_000, 0x1234ABCD, b"opus-bytes")


@pytest.mark.parametrize("data", [b"", b"\x80" * 11, bytes([0x40]) + bytes(15), bytes([0x81]) + bytes(13),
                                  bytes([0x90]) + bytes(13), _rtp(padding=4)[:-1] + b"\0", bytes([0x90]) + _rtp()[1:12] + b"\xbe\xde\xff\xff"])
def test_the_lean_rtp_parse_refuses_what_is_not_rtp(data):
    with pytest.raises(ValueError):
        rtp_audio.parse_rtp(data)


def test_opus_decodes_to_16k_as_48k_plus_resampling_does(packets):
    ours = _decoded(packets)
    assert ours.dtype == np.int16 and ours.size == SAMPLES * len(packets)
    codec = av.CodecContext.create("libopus", "r")  # the server's path before: 48 kHz, resampled
    codec.sample_rate, codec.layout, codec.format = 48000, "stereo", "s16"
    resample = To16kMono()
    theirs = np.concatenate([resample.push(f) for p in packets for f in codec.decode(av.Packet(p))])
    n = min(ours.size, theirs.size)
    lag = max(range(-40, 41), key=lambda k: float(np.dot(ours[100 + k : n - 100 + k].astype(float), theirs[100 : n - 100])))
    a, b = ours[100 + lag : n - 100 + lag].astype(float), theirs[100 : n - 100].astype(float)
    assert np.corrcoef(a, b)[0, 1] > 0.95, lag


def test_a_corrupt_packet_is_refused():
    with pytest.raises(rtp_audio.OpusError):
        OpusDecoder16k().decode(b"\xff\xff\xff")


# --- the packet timeline ------------------------------------------------------------------------

def _play(packets: list[tuple[int, int, bytes]], flush: bool = True) -> tuple[np.ndarray, Reorder]:
    out = PcmList()
    reorder = Reorder(out)
    for seq, ts, payload in packets:
        reorder.add(seq, ts, payload)
    if flush:
        reorder.flush()
    return (np.concatenate(out) if out else np.zeros(0, np.int16)), reorder


def _stream(packets: list[bytes], seq0: int = 1000, ts0: int = 5000) -> list[tuple[int, int, bytes]]:
    return [((seq0 + i) & 0xFFFF, (ts0 + i * TICKS) & 0xFFFFFFFF, p) for i, p in enumerate(packets)]


def test_in_order_and_reordered_packets_give_the_same_audio(packets):
    stream = _stream(packets)
    reference = _decoded(packets)
    in_order, _ = _play(stream)
    assert np.array_equal(in_order, reference)
    shuffled = stream[:]
    for i in range(10, len(shuffled) - 3, 7):  # pairs swapped, and one packet three places late
        shuffled[i], shuffled[i + 1] = shuffled[i + 1], shuffled[i]
    shuffled.insert(55, shuffled.pop(52))
    reordered, reorder = _play(shuffled, flush=False)
    assert np.array_equal(reordered, reference[: reordered.size]) and reference.size - reordered.size <= HOLD * SAMPLES
    assert reorder.concealed == reorder.late == 0
    wrapped, _ = _play(_stream(packets, seq0=65530, ts0=2**32 - 3 * TICKS))  # both counters wrap
    assert np.array_equal(wrapped, reference)


def test_lost_packets_keep_their_place_on_the_timeline(speech):
    packets = _encode(speech, fec=True)
    stream = _stream(packets)
    lost = {20, 40, 41, 42, 60}
    out, reorder = _play([p for i, p in enumerate(stream) if i not in lost])
    assert out.size == len(packets) * SAMPLES  # the same length: the VAD's clock is the stream's
    assert reorder.concealed == 3  # three gaps, each concealed
    assert np.abs(out[20 * SAMPLES : 21 * SAMPLES]).max() > 0  # concealed from speech, not zeros
    reference = _decoded(packets)
    assert np.array_equal(out[: 20 * SAMPLES], reference[: 20 * SAMPLES])


def test_a_packet_given_up_on_comes_too_late_and_duplicates_are_dropped(packets):
    stream = _stream(packets[:30])
    late = stream[10]
    order = stream[:10] + stream[11 : 12 + HOLD] + [late, stream[5]] + stream[12 + HOLD :]
    out, reorder = _play(order)
    assert reorder.late == 2 and reorder.concealed == 1
    assert out.size == 30 * SAMPLES


def test_a_pause_in_the_timestamps_becomes_silence_up_to_a_limit(packets):
    stream = _stream(packets[:20])
    paused = stream[:10] + [(seq, ts + 48000, p) for seq, ts, p in stream[10:]]  # a sender silent for 1 s (DTX)
    out, reorder = _play(paused)
    assert out.size == 20 * SAMPLES + 16000 and reorder.concealed == 1
    assert not out[10 * SAMPLES + 2000 : 10 * SAMPLES + 16000].any()  # silence after the concealment fades
    jumped = stream[:10] + [(seq, ts + 48000 * 60, p) for seq, ts, p in stream[10:]]
    out, _ = _play(jumped)
    assert out.size == 20 * SAMPLES + MAX_GAP
    backwards = stream[:10] + [(seq, ts - 48000, p) for seq, ts, p in stream[10:]]
    assert _play(backwards)[0].size == 20 * SAMPLES


def test_a_corrupt_packet_costs_its_own_time_only(packets):
    stream = _stream(packets[:20])
    stream[7] = (stream[7][0], stream[7][1], b"\xff\xff\xff")
    out, reorder = _play(stream)
    assert reorder.bad == 1 and reorder.concealed == 1 and out.size == 20 * SAMPLES


# --- a real peer into webrtc.answer -------------------------------------------------------------

class Packets(MediaStreamTrack):
    """A microphone of Opus packets at `speed` x real time (aiortc sends an av.Packet as it is)."""

    kind = "audio"

    def __init__(self, packets: list[bytes], speed: float = 1.0) -> None:
        super().__init__()
        self.packets, self.speed, self.sent = packets, speed, 0
        self._start: float | None = None

    async def recv(self) -> av.Packet:
        self._start = self._start or time.monotonic()
        await asyncio.sleep(max(0.0, self._start + self.sent * 0.02 / self.speed - time.monotonic()))
        if self.sent >= len(self.packets):
            self.stop()
            raise MediaStreamError
        packet = av.Packet(self.packets[self.sent])
        packet.pts, packet.time_base = self.sent * TICKS, fractions.Fraction(1, 48000)
        self.sent += 1
        return packet


async def _connect(track: MediaStreamTrack, on_pcm, on_end, offer_filter=lambda sdp: sdp):  # noqa: ANN001
    webrtc.use_host_addresses(["127.0.0.1"])
    client = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    client.addTrack(track)
    await client.setLocalDescription(await client.createOffer())
    server, answer = await webrtc.answer(offer_filter(client.localDescription.sdp), [], PcmTo(on_pcm), on_end,
                                         CandidatePolicy.of([], ["127.0.0.1"]))
    await client.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
    return client, server, answer


def test_a_peer_is_decoded_in_the_event_loop_and_ends_once(packets):
    got: list[np.ndarray] = []
    ended: list[bool] = []

    async def body() -> tuple[list[str], str]:
        client, server, answer = await _connect(Packets(packets[:100]), got.append, lambda: ended.append(True))
        for _ in range(100):
            if sum(g.size for g in got) >= 60 * SAMPLES:
                break
            await asyncio.sleep(0.05)
        threads = [t.name for t in threading.enumerate()]
        shortcut = server.getTransceivers()[0].receiver.transport.transport._connection
        assert type(shortcut) is rtp_audio._SrtpShortcut and shortcut._srtp is not None
        pair = shortcut._nominated.get(1)
        found = {"Connection._nominated": pair is not None, "CandidatePair.protocol": hasattr(pair, "protocol"),
                 "StunProtocol.receiver": getattr(pair.protocol, "receiver", None) is shortcut,
                 "StunProtocol.local_candidate": getattr(pair.protocol, "local_candidate", None) is not None}
        assert sorted(found) == sorted(rtp_audio.AIOICE_INTERNALS) and all(found.values()), found
        assert type(pair.protocol) is rtp_audio._RtpFirstProtocol  # RTP skips aioice's STUN parse
        assert "stun.parse_message(data)" in inspect.getsource(aioice.ice.StunProtocol.datagram_received)
        await client.close()
        for _ in range(100):
            if ended:
                break
            await asyncio.sleep(0.05)
        await server.close()
        return threads, answer

    threads, answer = asyncio.run(asyncio.wait_for(body(), 30))
    assert not [t for t in threads if "decoder" in t], threads  # aiortc's receiver would run "audio-decoder"
    assert sum(g.size for g in got) >= 60 * SAMPLES and all(g.dtype == np.int16 for g in got)
    assert ended == [True]
    assert re.findall(r"a=rtpmap:\d+ (\S+)", answer) == ["opus/48000/2"]  # Opus only


def test_text_that_is_not_utf8_closes_the_recovery_channel_and_the_audio_goes_on(packets, caplog):
    """aiortc decodes a data channel's text inside its transport; bytes that are not UTF-8 ended
    the whole peer there (its audio too) with a traceback. They are refused on the channel
    instead, with the recovery channel's clear error, and the peer's audio keeps coming."""
    from aiortc.rtcsctptransport import WEBRTC_STRING

    from streamserver.audio.pacing import Pacer
    from streamserver.audio.pipeline import StudentAudio
    from streamserver.transport import recovery
    from tests.takers import UtteranceList

    got: list[np.ndarray] = []
    replies: list[str] = []

    async def body() -> tuple[str, int, int]:
        webrtc.use_host_addresses(["127.0.0.1"])
        audio = StudentAudio("r", "s", "Ann", "en", UtteranceList(), pacer=Pacer())
        client = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        client.addTrack(Packets(packets[:150]))
        channel = client.createDataChannel(recovery.LABEL)
        channel.on("message", replies.append)
        await client.setLocalDescription(await client.createOffer())
        server, answer = await webrtc.answer(client.localDescription.sdp, [], PcmTo(got.append), lambda: None,
                                             CandidatePolicy.of([], ["127.0.0.1"]),
                                             on_channel=lambda c: recovery.attach(c, audio, Pacer))
        await client.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        for _ in range(200):
            if channel.readyState == "open" and sum(g.size for g in got) >= 25 * SAMPLES:
                break
            await asyncio.sleep(0.05)
        assert channel.readyState == "open"
        sctp = client.sctp
        sctp._data_channel_queue.append((channel, WEBRTC_STRING, b'{"type": "bye\xff"}'))
        await sctp._data_channel_flush()
        for _ in range(100):
            if replies:
                break
            await asyncio.sleep(0.05)
        before = sum(g.size for g in got)
        await asyncio.sleep(1.0)
        after = sum(g.size for g in got)
        state = server.connectionState
        await client.close()
        await server.close()
        return state, before, after

    with caplog.at_level("WARNING"):
        state, before, after = asyncio.run(asyncio.wait_for(body(), 30))
    assert [json.loads(r) for r in replies] == [{"type": "error", "error": "a text message must be UTF-8"}]
    assert state == "connected" and after - before >= 30 * SAMPLES  # a second later the audio still comes
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def test_receiver_reports_reach_the_student_and_time_its_round_trip(packets, monkeypatch):
    """The gateway's own receiver reports (every RTCP_INTERVAL_S, shortened here): the student's
    aiortc sender finds its last sender report in one (LSR) and so gets a round-trip time; the
    delay since that report (DLSR) is the time since the gateway received it, and the packets
    the student sent are counted (the extended highest sequence number)."""
    monkeypatch.setattr(rtp_audio, "RTCP_INTERVAL_S", 0.2)

    async def body() -> tuple[float | None, list, tuple]:
        client, server, _ = await _connect(Packets(packets[:300]), lambda pcm: None, lambda: None)
        sender, receiver = client.getSenders()[0], server.getTransceivers()[0].receiver
        reports: list = []
        handle = sender._handle_rtcp_packet

        async def seen(packet) -> None:  # noqa: ANN001 - aiortc's RTCP packet
            reports.append(packet)
            await handle(packet)

        sender._handle_rtcp_packet = seen
        for _ in range(150):  # the student's first sender report comes 0.5-1.5 s in
            if sender._RTCRtpSender__rtt is not None:
                break
            await asyncio.sleep(0.1)
        own = receiver._receiver_report()
        at, received = time.time(), dict(receiver._RTCRtpReceiver__lsr_time)
        stats = next(iter(receiver._RTCRtpReceiver__remote_streams.values()))
        extended, rtt = stats.cycles + stats.max_seq, sender._RTCRtpSender__rtt  # before any await
        await client.close()
        await server.close()
        return rtt, reports, (own, at, received, extended)

    rtt, reports, (own, at, received, extended) = asyncio.run(asyncio.wait_for(body(), 40))
    assert rtt is not None  # a report answered the student's last sender report
    (block,) = own.reports
    assert block.lsr > 0
    assert abs(block.dlsr / 65536 - (at - received[block.ssrc])) < 0.01, (block.dlsr, at, received)
    assert block.highest_sequence == extended > 0
    rr = [p for p in reports if type(p).__name__ == "RtcpRrPacket"]
    assert rr and all(len(p.reports) == 1 and p.reports[0].highest_sequence > 0 for p in rr)


def test_a_peer_faster_than_real_time_is_closed(packets):
    ended: list[bool] = []

    async def body() -> str:
        pacer = Pacer(rate=1.5)
        client, server, _ = await _connect(Packets(packets * 3, speed=4.0), lambda pcm: pacer.take(pcm.size),
                                           lambda: ended.append(True))
        for _ in range(200):
            if server.connectionState == "closed":
                break
            await asyncio.sleep(0.05)
        state = server.connectionState
        await client.close()
        return state

    assert asyncio.run(asyncio.wait_for(body(), 30)) == "closed"
    assert ended == [True]


def test_an_offer_without_opus_is_refused_and_video_is_not_received(packets):
    def pcmu_only(sdp: str) -> str:
        return re.sub(r"(m=audio \d+ \S+) .*", r"\1 0", sdp).replace("a=rtpmap:96 opus/48000/2", "")

    async def body() -> None:
        with pytest.raises(webrtc.OfferError):
            await _connect(Packets(packets[:10]), lambda pcm: None, lambda: None, pcmu_only)
        client = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        client.addTrack(Packets(packets[:10]))
        client.addTransceiver("video", direction="sendonly")
        await client.setLocalDescription(await client.createOffer())
        server, answer = await webrtc.answer(client.localDescription.sdp, [], PcmList(), lambda: None,
                                             CandidatePolicy.of([], ["127.0.0.1"]))
        video = answer[answer.index("m=video") :]
        assert "a=inactive" in video and "a=recvonly" in answer[: answer.index("m=video")]
        await client.close()
        await server.close()

    asyncio.run(asyncio.wait_for(body(), 30))
