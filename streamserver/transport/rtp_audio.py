"""A student's WebRTC audio from RTP packet to 16 kHz PCM in the event loop, without aiortc's
decoder thread.

aiortc's RTCRtpReceiver hands every packet to a thread of its own per track, which decodes Opus
to 48 kHz stereo and hands each frame back to the event loop; the server then resampled it to
16 kHz mono. At 20 ms packets that is two thread hand-offs, a resampler run and a handful of
Python objects per packet per student: most of a gateway's CPU. Here aiortc keeps signalling,
ICE, DTLS, SRTP and RTCP; its receiver's RTP handler is replaced (AudioReceiver, installed with
install() on the receiver of the student's audio before it starts) by one that puts the packet
in sequence order (Reorder) and decodes it at once with libopus, at 16 kHz mono (OpusDecoder16k:
Opus decodes at 16 kHz natively; FFmpeg's libopus wrapper, which is all PyAV exposes, always
decodes at 48 kHz).

A lost packet keeps its place on the timeline: libopus conceals it (in-band FEC from the next
packet when it carries it, else packet loss concealment), a longer gap in the RTP timestamps
(a sender's discontinuous transmission) becomes silence (while an utterance is open,
as the time passes: transport/dtx.py), so the VAD sees the stream's own
timeline and an utterance ends after the same hangover as over the WebSocket ingest.

Receiver reports go to the student every RTCP_INTERVAL_S (randomised 0.5-1.5x as RFC 3550
asks): libwebrtc's interval for an audio stream, where aiortc reports every 0.5-1.5 s. A browser
sends its own sender reports for audio at that interval too.

This relies on aiortc internals: the names in AIORTC_INTERNALS, checked against the pinned
aiortc (pyproject.toml) by tests/test_rtp_audio.py.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import random
import struct
import time
from contextlib import suppress
from pathlib import Path
from typing import Awaitable, Callable, NamedTuple

import aioice
import aioice.ice
import numpy as np
import pylibsrtp
from aiortc import RTCRtpReceiver
from aiortc.rtcdtlstransport import RTCDtlsTransport
from aiortc.rtcicetransport import RTCIceTransport
from aiortc.rtcrtpreceiver import StreamStatistics
from aiortc.rtp import RtcpByePacket, RtcpReceiverInfo, RtcpRrPacket, RtpPacket, is_rtcp

from streamserver.stages import PcmTaker
from streamserver.transport import dtx

log = logging.getLogger(__name__)

RATE = 16_000  # what the VAD takes; libopus decodes to it directly
RTP_RATE = 48_000  # Opus's RTP clock, whatever the sample rate decoded
TICKS_PER_SAMPLE = RTP_RATE // RATE
MAX_FRAME = RATE * 120 // 1000  # the longest Opus packet: 120 ms
STEP = RATE // 400  # 2.5 ms, Opus's shortest frame
MAX_CONCEALED = RATE * 120 // 1000  # longer gaps are silence: concealment fades out within ~100 ms
MAX_GAP = RATE * 2  # the most silence put in for a gap; a longer jump in timestamps resynchronises
HOLD = 3  # packets held after a missing one (60 ms at 20 ms) before it is given up as lost
MAX_JUMP = 1000  # sequence numbers: a larger jump is a new start, not a loss
OPUS_OK = 0
RTCP_INTERVAL_S = 5.0  # between receiver reports: libwebrtc's for audio (aiortc's 1 s and the students' own were a fifth of a silent student's cost)

# (class, attribute) pairs of aiortc this module reads or writes; the test fails if one goes.
AIORTC_INTERNALS = (
    (RTCRtpReceiver, "_RTCRtpReceiver__codecs"),
    (RTCRtpReceiver, "_RTCRtpReceiver__remote_streams"),
    (RTCRtpReceiver, "_RTCRtpReceiver__rtcp_task"),
    (RTCRtpReceiver, "_RTCRtpReceiver__started"),
    (RTCRtpReceiver, "_RTCRtpReceiver__decoder_thread"),
    (RTCRtpReceiver, "_RTCRtpReceiver__rtcp_started"),
    (RTCRtpReceiver, "_RTCRtpReceiver__rtcp_exited"),
    (RTCRtpReceiver, "_RTCRtpReceiver__rtcp_ssrc"),
    (RTCRtpReceiver, "_RTCRtpReceiver__lsr"),
    (RTCRtpReceiver, "_RTCRtpReceiver__lsr_time"),
    (RTCRtpReceiver, "_send_rtcp"),
    (RTCRtpReceiver, "_track"),
    (RTCRtpReceiver, "_enabled"),
    (RTCIceTransport, "_connection"),
    (RTCDtlsTransport, "_rx_srtp"),
)
# ... and of aioice (instance attributes: checked on a connected peer by the test)
AIOICE_INTERNALS = ("Connection._nominated", "CandidatePair.protocol", "StunProtocol.receiver",
                    "StunProtocol.local_candidate")


class OpusError(ValueError):
    """libopus refused a packet (corrupt or not Opus)."""


def _libopus_paths() -> list[str]:
    """The libopus PyAV ships (it links FFmpeg against it), then the system's."""
    import av

    package = Path(av.__file__).resolve().parent
    found = [str(p) for folder in (package.parent / "av.libs", package / ".dylibs")
             for p in sorted(folder.glob("*opus*")) if p.is_file()]
    system = ctypes.util.find_library("opus")
    return found + ([system] if system else [])


@functools.cache
def libopus() -> ctypes.CDLL | None:
    for path in _libopus_paths():
        try:
            lib = ctypes.CDLL(path)
            lib.opus_decoder_create.restype = ctypes.c_void_p
            lib.opus_decoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            lib.opus_decode.restype = ctypes.c_int
            lib.opus_decode.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int,
                                        ctypes.c_int]
            lib.opus_decoder_destroy.restype = None
            lib.opus_decoder_destroy.argtypes = [ctypes.c_void_p]
            return lib
        except (OSError, AttributeError):
            continue
    return None


class OpusDecoder16k:
    """One per stream (Opus carries state from packet to packet): packets in, 16 kHz mono int16
    out, and the audio of lost packets concealed."""

    def __init__(self) -> None:
        lib = libopus()
        if lib is None:
            raise RuntimeError("no libopus found (PyAV's wheel ships one; or install the system's libopus)")
        error = ctypes.c_int()
        self._lib = lib
        self._state = lib.opus_decoder_create(RATE, 1, ctypes.byref(error))
        if error.value != OPUS_OK or not self._state:
            raise RuntimeError(f"opus_decoder_create failed ({error.value})")
        self._out = np.zeros(MAX_FRAME, np.int16)
        self._out_ptr = self._out.ctypes.data

    def decode(self, payload: bytes) -> np.ndarray:
        n = self._lib.opus_decode(self._state, payload, len(payload), self._out_ptr, MAX_FRAME, 0)
        if n < 0:
            raise OpusError(f"not an Opus packet (libopus error {n})")
        return self._out[:n].copy()

    def conceal(self, samples: int, next_payload: bytes | None = None) -> np.ndarray:
        """`samples` (at most MAX_CONCEALED) of audio for packets that never came: libopus's
        loss concealment, ending with the in-band FEC of `next_payload` (the packet after them)
        where it carries one."""
        step = min(samples, MAX_CONCEALED) // STEP * STEP  # Opus conceals whole 2.5 ms steps
        n = 0
        if step:
            data = next_payload or None
            n = max(0, self._lib.opus_decode(self._state, data, len(data) if data else 0, self._out_ptr, step, int(data is not None)))
        out = np.zeros(samples, np.int16)
        out[:n] = self._out[:n]
        return out

    def __del__(self) -> None:
        if getattr(self, "_state", None):
            self._lib.opus_decoder_destroy(self._state)
            self._state = None


class Reorder:
    """Packets of one stream (sequence number, RTP timestamp, payload) to 16 kHz PCM in order.

    A packet that comes early waits for the ones before it, at most HOLD packets; then those are
    lost and concealed. A packet that comes after its place was concealed, and a duplicate, are
    dropped. Gaps in the timestamps (a lost packet, or a sender pausing) are filled up to
    MAX_GAP, so that the PCM follows the sender's clock."""

    def __init__(self, out: PcmTaker, decoder: OpusDecoder16k | None = None) -> None:
        self.out = out
        self.decoder = decoder or OpusDecoder16k()
        self._next_seq: int | None = None
        self._end_ts = 0  # RTP timestamp where the audio handed on so far ends
        self._held: dict[int, tuple[int, bytes]] = {}
        self.late = self.concealed = self.bad = 0  # packets, for tests and logs

    def add(self, seq: int, ts: int, payload: bytes) -> None:
        if self._next_seq is None:
            self._next_seq, self._end_ts = seq, ts
        ahead = (seq - self._next_seq) & 0xFFFF
        if ahead == 0:
            self._play(ts, payload)
            if self._held:
                self._drain()
        elif ahead >= 0x8000:  # behind: its place is already filled
            self.late += 1
        elif ahead > MAX_JUMP:  # the sender started over: a new timeline
            self._held.clear()
            self._next_seq, self._end_ts = seq, ts
            self._play(ts, payload)
        else:
            self._held[seq] = (ts, payload)
            if len(self._held) > HOLD:
                self._next_seq = min(self._held, key=lambda s: (s - self._next_seq) & 0xFFFF)
                self._drain()

    @property
    def end_ts(self) -> int:
        """The RTP timestamp where the audio handed on so far ends."""
        return self._end_ts

    def fill_silence(self, until_ts: int) -> None:
        """The sender is silent (DTX) up to `until_ts`: hand on its silence now rather than when
        its next packet comes; that packet then fills only what is left of its gap. A packet
        still held for a missing one is played first, its loss concealed: under DTX the HOLD
        packets that would give the loss up may be a second away."""
        if self._next_seq is None:
            return
        self.flush()
        ticks = (until_ts - self._end_ts) & 0xFFFFFFFF
        if 0 < ticks < 1 << 31 and (samples := min(ticks // TICKS_PER_SAMPLE, MAX_GAP)):
            self._end_ts = (self._end_ts + samples * TICKS_PER_SAMPLE) & 0xFFFFFFFF
            self.out.push_pcm16(np.zeros(samples, np.int16))

    def flush(self) -> None:
        """The stream ended: what is held is played, gaps concealed."""
        while self._held:
            self._next_seq = min(self._held, key=lambda s: (s - self._next_seq) & 0xFFFF)
            self._drain()

    def _drain(self) -> None:
        while (held := self._held.pop(self._next_seq, None)) is not None:
            self._play(*held)

    def _play(self, ts: int, payload: bytes) -> None:
        assert self._next_seq is not None
        self._next_seq = (self._next_seq + 1) & 0xFFFF
        ticks = (ts - self._end_ts) & 0xFFFFFFFF
        filler = None
        # Behind where the audio handed on ends: silence filled early (DTX) that this packet's
        # audio overlaps, or a sender's glitch. The overlap is dropped: the timeline never runs back.
        overlap = ((1 << 32) - ticks) // TICKS_PER_SAMPLE if ticks >= 1 << 31 else 0
        if overlap > MAX_CONCEALED:  # a larger step back is the sender's clock starting over: followed
            overlap = 0
        if 0 < ticks < 1 << 31:  # a gap before this packet
            self.concealed += 1
            gap = min(ticks // TICKS_PER_SAMPLE, MAX_GAP)
            # concealed before this packet is decoded: libopus's state goes on from the concealed audio
            filler = self.decoder.conceal(gap, payload) if gap <= MAX_CONCEALED else np.zeros(gap, np.int16)
            self._end_ts = ts
        try:
            pcm = self.decoder.decode(payload) if payload else None
        except OpusError:
            self.bad += 1  # its own time is filled when the next packet comes
            pcm = None
        if pcm is not None and overlap:
            if overlap >= pcm.size:
                return
            pcm, ts = pcm[overlap:], (ts + overlap * TICKS_PER_SAMPLE) & 0xFFFFFFFF
        if pcm is not None:
            self._end_ts = (ts + pcm.size * TICKS_PER_SAMPLE) & 0xFFFFFFFF
            pcm = pcm if filler is None else np.concatenate([filler, pcm])  # one hand-off, not two
        else:
            pcm = filler
        if pcm is not None and pcm.size:
            self.out.push_pcm16(pcm)


class RtpAudio(NamedTuple):
    """What the receiver reads of an RTP packet (the names of aiortc's RtpPacket, which
    StreamStatistics reads too)."""

    payload_type: int
    sequence_number: int
    timestamp: int
    ssrc: int
    payload: bytes


_HEADER = struct.Struct("!BBHLL")


def parse_rtp(data: bytes) -> RtpAudio:
    """An RTP packet's header and payload; header extensions (audio level, transport-wide
    sequence numbers: nothing the audio needs) skipped rather than parsed as aiortc's
    RtpPacket.parse does, and no packet object built. ValueError for what is not RTP."""
    if len(data) < 12:
        raise ValueError("RTP packet shorter than its header")
    v_p_x_cc, m_pt, seq, ts, ssrc = _HEADER.unpack_from(data)
    if v_p_x_cc >> 6 != 2:
        raise ValueError("not RTP version 2")
    pos = 12 + 4 * (v_p_x_cc & 0x0F)  # after the CSRCs
    if v_p_x_cc & 0x10:  # an extension header: 16-bit profile, 16-bit length in words
        if len(data) < pos + 4:
            raise ValueError("RTP extension header truncated")
        pos += 4 + 4 * int.from_bytes(data[pos + 2:pos + 4], "big")
    end = len(data)
    if v_p_x_cc & 0x20:  # padding: its length in the last byte
        end -= data[-1]
        if data[-1] == 0:
            raise ValueError("RTP padding length is invalid")
    if pos > end:
        raise ValueError("RTP packet truncated")
    return RtpAudio(m_pt & 0x7F, seq, ts, ssrc, data[pos:end])


async def send_audio_rtcp(started: asyncio.Event, send: Callable[[], Awaitable[None]], what: str) -> None:
    """`send` a report every RTCP_INTERVAL_S (randomised 0.5-1.5x) until cancelled, `started` set
    first: an audio stream's either end (the gateway's receiver, a simulated student's sender).
    A report that fails is logged as `what` and the next goes out as usual."""
    started.set()
    with suppress(asyncio.CancelledError):
        while True:
            await asyncio.sleep(RTCP_INTERVAL_S * (0.5 + random.random()))
            try:
                await send()
            except Exception:  # noqa: BLE001 - one report lost; the stream goes on
                log.exception("%s failed", what)


class _SrtpShortcut(aioice.Connection):
    """aioice's ICE connection of one peer, handing its SRTP packets (not SRTCP, DTLS or STUN)
    straight to the student's receiver from the datagram callback: no queue, no hop to the DTLS
    transport's task and its chain of coroutines per packet. Set on the connection of an
    AudioReceiver's peer once DTLS is up (its SRTP keys are set then); everything else keeps
    aiortc's path."""

    _srtp: Callable[[bytes], None] | None = None

    def data_received(self, data: bytes, component: int) -> None:
        if self._srtp is not None and 127 < data[0] < 192 and not is_rtcp(data):
            self._srtp(data)
        else:
            super().data_received(data, component)


class _RtpFirstProtocol(aioice.ice.StunProtocol):
    """aioice's socket protocol of the nominated pair, handing RTP/RTCP (first byte 128-191; a
    STUN message's is 0 or 1) to the connection without first trying to parse it as STUN, which
    aioice does for every datagram (an exception per packet)."""

    def datagram_received(self, data: bytes, addr: tuple) -> None:  # type: ignore[override]
        if data and 127 < data[0] < 192:
            self.receiver.data_received(data, self.local_candidate.component)
        else:
            super().datagram_received(data, addr)


class AudioReceiver(RTCRtpReceiver):
    """aiortc's receiver for one student's audio, decoding in the event loop: no decoder thread,
    no decoded frames through the track, its SRTP taken at the ICE connection (_SrtpShortcut).
    RTCP (receiver reports, BYE), stats and stopping stay aiortc's. Installed with install();
    never constructed."""

    _reorder: Reorder
    _batcher: Batcher
    _on_end: Callable[[], None]
    _on_error: Callable[[BaseException], None]
    _open: Callable[[], bool]
    _ended: bool
    _ssrc: int | None
    _dtx_from: tuple[float, int] | None  # in DTX since (monotonic arrival, RTP timestamp of the audio's end)
    packets: int  # received (after SRTP), for the stream's end log
    dtx_packets: int  # of them, DTX packets (the sender went quiet)

    async def receive(self, parameters) -> None:  # noqa: ANN001 - aiortc's RTCRtpReceiveParameters
        """aiortc's receive() without its decoder thread: the codecs, the transport's routing and
        RTCP; then the shortcut for SRTP."""
        if self._RTCRtpReceiver__started:
            return
        for codec in parameters.codecs:
            self._RTCRtpReceiver__codecs[codec.payloadType] = codec
        self.transport._register_rtp_receiver(self, parameters)
        self._RTCRtpReceiver__rtcp_task = asyncio.ensure_future(self._run_rtcp())
        self._RTCRtpReceiver__started = True
        self._take_srtp()

    def _take_srtp(self) -> None:
        dtls = self.transport
        connection = dtls.transport._connection
        srtp = dtls._rx_srtp
        if srtp is None or type(connection) not in (aioice.Connection, _SrtpShortcut):
            return  # aiortc's own path carries the packets

        def on_srtp(data: bytes) -> None:
            try:
                packet = parse_rtp(srtp.unprotect(data))
            except (pylibsrtp.Error, ValueError):  # not this peer's, replayed, or garbled: dropped, as aiortc does
                return
            self._receive(packet)

        connection.__class__ = _SrtpShortcut
        connection._srtp = on_srtp
        pair = connection._nominated.get(1)
        if pair is not None and type(pair.protocol) is aioice.ice.StunProtocol:
            pair.protocol.__class__ = _RtpFirstProtocol

    async def _run_rtcp(self) -> None:
        """Receiver reports at an audio sender's pace; aiortc's stop() waits for the two events."""
        try:
            await send_audio_rtcp(self._RTCRtpReceiver__rtcp_started, self._send_receiver_report,
                                  "a receiver report to a student")
        finally:
            self._RTCRtpReceiver__rtcp_exited.set()

    async def _send_receiver_report(self) -> None:
        if (report := self._receiver_report()) is not None:
            await self._send_rtcp(report)

    def _receiver_report(self) -> RtcpRrPacket | None:
        """Loss, jitter, the extended highest sequence number (RFC 3550: wraps counted) and the
        last sender report's time (for the sender's round-trip time) of each stream received;
        None before the transceiver has given this side an SSRC."""
        ssrc, streams = self._RTCRtpReceiver__rtcp_ssrc, self._RTCRtpReceiver__remote_streams
        if ssrc is None or not streams:
            return None
        last_sr, last_sr_at, now = self._RTCRtpReceiver__lsr, self._RTCRtpReceiver__lsr_time, time.time()
        reports = []
        for source, stats in streams.items():
            since = now - last_sr_at[source] if source in last_sr else 0.0
            reports.append(RtcpReceiverInfo(ssrc=source, fraction_lost=stats.fraction_lost, packets_lost=stats.packets_lost,
                                            highest_sequence=stats.cycles + (stats.max_seq or 0), jitter=stats.jitter,
                                            lsr=last_sr.get(source, 0), dlsr=int(since * 65536) if 0 < since < 65536 else 0))
        return RtcpRrPacket(ssrc=ssrc, reports=reports)

    async def _handle_rtp_packet(self, packet: RtpPacket, arrival_time_ms: int) -> None:
        self._receive(packet)  # packets aiortc's path carried (before the shortcut was set)

    def _receive(self, packet: RtpPacket | RtpAudio) -> None:
        if not self._enabled or self._ended:
            return
        codec = self._RTCRtpReceiver__codecs.get(packet.payload_type)
        if codec is None:
            return
        if packet.ssrc != self._ssrc:  # the student's one stream (the shortcut does not route by SSRC)
            if self._ssrc is not None:
                return
            self._ssrc = packet.ssrc
        streams = self._RTCRtpReceiver__remote_streams
        stats = streams.get(packet.ssrc)
        if stats is None:
            stats = streams[packet.ssrc] = StreamStatistics(codec.clockRate)
        stats.add(packet)  # for the receiver reports aiortc sends the student
        self.packets += 1
        try:
            self._reorder.add(packet.sequence_number, packet.timestamp, packet.payload)
        except Exception as error:  # noqa: BLE001 - the audio's consumer refused it (TooFast) or failed
            self._on_error(error)
        if dtx.is_dtx(packet.payload):  # the student went quiet: silence from here on, unless packets come
            self.dtx_packets += 1
            self._dtx_from = (time.monotonic(), self._reorder.end_ts)
            if self._open():
                dtx.sweep().add(self)
        else:
            self._dtx_from = None

    def fill_silence(self, now: float) -> bool:
        """dtx.SilenceSweep's: while in DTX with an utterance open, its silence up to now."""
        if self._dtx_from is None or self._ended or not self._enabled or not self._open():
            return False
        arrived, end_ts = self._dtx_from
        # The DTX packet left when its frame ended, as the next packet will: MARGIN_S of jitter on
        # top of that frame still finds its place free.
        due = now - arrived - dtx.MARGIN_S - dtx.FRAME_S
        if due > 0:
            try:
                self._reorder.fill_silence((end_ts + int(due * RTP_RATE)) & 0xFFFFFFFF)
                self._batcher.flush()  # on time: the hangover is what is waited for
            except Exception as error:  # noqa: BLE001 - as in _receive
                self._on_error(error)
        return True

    async def _handle_rtcp_packet(self, packet) -> None:  # noqa: ANN001 - aiortc's RTCP packet types
        await super()._handle_rtcp_packet(packet)
        if isinstance(packet, RtcpByePacket):
            self._end()

    def _handle_disconnect(self) -> None:
        super()._handle_disconnect()
        self._end()

    async def stop(self) -> None:
        await super().stop()
        self._end()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True  # the silence sweep lets go of it at its next turn
        reorder = self._reorder
        log.info("WebRTC audio stream ended: %d packets (%d of them DTX: the sender went quiet), %d concealed, "
                 "%d late, %d not Opus", self.packets, self.dtx_packets, reorder.concealed, reorder.late, reorder.bad)
        connection = self.transport.transport._connection
        if isinstance(connection, _SrtpShortcut):
            connection._srtp = None
        try:
            self._reorder.flush()
            self._batcher.flush()
        except Exception as error:  # noqa: BLE001 - as in _receive
            self._on_error(error)
        if self._track is not None:
            self._track.stop()
        self._on_end()


class Batcher:
    """Hands the VAD 60 ms at a time instead of a packet's 20 ms: the pacer's and the segmenter's
    work per call (a bucket update, a concatenation, dtype checks) is paid once per three packets.
    The audio is the same; the VAD sees it at most 40 ms later."""

    def __init__(self, out: PcmTaker, samples: int = 3 * RATE // 50) -> None:
        self.out, self._samples = out, samples
        self._parts: list[np.ndarray] = []
        self._held = 0

    def push_pcm16(self, pcm: np.ndarray) -> None:
        self._parts.append(pcm)
        self._held += pcm.size
        if self._held >= self._samples:
            self.flush()

    def flush(self) -> None:
        if self._parts:
            parts, self._parts, self._held = self._parts, [], 0
            self.out.push_pcm16(parts[0] if len(parts) == 1 else np.concatenate(parts))


def install(receiver: RTCRtpReceiver, stream: PcmTaker, on_end: Callable[[], None],
            on_error: Callable[[BaseException], None], utterance_open: Callable[[], bool] = lambda: False,
            ) -> AudioReceiver:
    """Make the (not yet started) audio receiver of a peer an AudioReceiver: each packet's audio
    goes to `stream` as 16 kHz mono int16, in order; on_end once when the stream ends (the peer
    closed, disconnected or sent BYE); an exception from the stream goes to on_error and it
    goes on. `utterance_open` says whether the stream's VAD has an utterance open: while it has,
    the silence of a sender in DTX is handed on as time passes (transport/dtx.py). aiortc builds
    receivers itself (no factory to hand it), so the class of this one
    instance is changed; other peers in the process (aiortc clients) keep aiortc's."""
    if type(receiver) is not RTCRtpReceiver or receiver._RTCRtpReceiver__started:
        raise ValueError("install() takes an aiortc RTCRtpReceiver that has not started")
    if receiver._RTCRtpReceiver__decoder_thread is not None:
        raise ValueError("the receiver already runs a decoder thread")
    receiver.__class__ = AudioReceiver
    assert isinstance(receiver, AudioReceiver)
    batcher = Batcher(stream)
    receiver._reorder = Reorder(batcher)
    receiver._batcher = batcher
    receiver._on_end, receiver._on_error, receiver._ended, receiver._ssrc = on_end, on_error, False, None
    receiver._open, receiver._dtx_from = utterance_open, None
    receiver.packets = receiver.dtx_packets = 0
    return receiver
