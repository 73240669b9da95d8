"""Simulated students over WebRTC that cost little: a real aiortc peer (ICE, DTLS, SRTP, RTCP)
whose microphone hands aiortc Opus packets encoded once per clip and process, shared by every
student, instead of audio that aiortc would encode for each student in its thread pool.

aiortc's RTCRtpSender sends an `av.Packet` from a track as it is (it only packs it into RTP:
`Encoder.pack`), so a track whose recv() returns Opus packets at the right times is a browser
microphone as far as the server can tell: 20 ms packets on the 48 kHz RTP clock, continuous
timestamps; in silence, what a browser sends when the server's answer asks for DTX (its
`usedtx=1`: transport/dtx.py), almost nothing, and otherwise a packet every 20 ms. Encoding per
student instead (aiortc's MediaPlayer, a decoding thread per student and aiortc's Opus encoder
in one thread pool: ~30 ms of CPU per
student-second here, against ~3 ms for this client) saturated the simulator process at 40-50
students on 2 cores: its audio fell behind real time (20 s behind after 40 s with 50 students),
and what the students had not sent when they hung up never reached the server (issue 13).

One PacketClock per process paces every track: a track waits for its next packet's tick, and
one timer releases all the packets due at a tick together (not a timer per student per packet).
A student that falls behind (an overloaded simulator) sends what is due at once, and the clock
reports how late it woke (`lag`, the report's simulator_max_lag_s).
"""

from __future__ import annotations

import asyncio
import fractions
import functools
import logging
import random
import struct
import time
from typing import Callable, NamedTuple

import av
import numpy as np
from aiortc import RTCRtpSender
from aiortc.clock import current_ntp_time
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import RtcpByePacket, RtcpSdesPacket, RtcpSenderInfo, RtcpSourceInfo, RtcpSrPacket

from streamserver.loadsim.config import LoadConfig
from streamserver.loadsim.opus_encoder import OpusEncoder, sent_as_browser
from streamserver.loadsim.scenario import RATE, Turn, load_clips
from streamserver.transport.dtx import is_dtx
from streamserver.transport.rtp_audio import send_audio_rtcp
from streamserver.loadsim.ws_student import PlayHooks

log = logging.getLogger(__name__)
OPUS_RATE = 48_000  # RTP's Opus clock, and what a browser's microphone captures at
PACKET_S = 0.020  # of audio per packet (browsers' and aiortc's ptime)
PACKET_SAMPLES = int(OPUS_RATE * PACKET_S)
TIME_BASE = fractions.Fraction(1, OPUS_RATE)
BITRATE = 32_000  # a browser's default for mono speech
# Each clip is encoded with silence around it by its own encoder, so that the stream switches
# between the shared silence packet and a clip's packets inside silence (no clicks at the
# seams, and the encoder has settled before the speech starts).
LEAD_PACKETS = 5
TAIL_PACKETS = 10
DTX_TAIL_PACKETS = 20  # libopus goes into DTX after 10 quiet frames: the clip ends with its DTX packet


CONSENT_EXPIRED = "Consent to send expired"  # aioice's INFO line when it closes a connection for it


class _ConsentWatch(logging.Filter):
    """On aioice's logger: counts the connections of this process that aioice closed because six
    consent checks in a row (RFC 7675, one every ~5 s, 0.5 s each, no retransmission) went
    unanswered, which is how a peer that reads its socket seconds late loses its students ~30 s
    in; every other INFO line of aioice is dropped as before (it logs each ICE check)."""

    def __init__(self) -> None:
        super().__init__()
        self.listeners: list[Callable[[], None]] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and str(record.msg).endswith(CONSENT_EXPIRED):
            for listener in self.listeners:
                listener()
        return record.levelno >= logging.WARNING


@functools.cache
def _consent_watch() -> _ConsentWatch:
    watch = _ConsentWatch()
    logger = logging.getLogger("aioice.ice")
    logger.addFilter(watch)
    logger.setLevel(logging.INFO)  # the filter lets only its warnings through
    return watch


def on_consent_expired(listener: Callable[[], None]) -> None:
    """Call `listener` whenever this process's aioice closes a connection for lack of consent."""
    _consent_watch().listeners.append(listener)


def opus_packets(pcm16k: np.ndarray, dtx: bool = False) -> list[bytes]:
    """16 kHz mono int16 as 20 ms Opus packets, mono at 48 kHz like a browser's (libopus picks
    the coded bandwidth), with DTX or without; a packet of silence after the audio carries the
    end of the encoder's delay, so the audio ends inside the packets."""
    encoder = OpusEncoder(OPUS_RATE, BITRATE, dtx)
    resampler = av.AudioResampler(format="s16", layout="mono", rate=OPUS_RATE)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm16k, dtype=np.int16)[None], format="s16", layout="mono")
    frame.sample_rate = RATE
    pcm48k = np.concatenate([f.to_ndarray()[0] for f in resampler.resample(frame) + resampler.resample(None)])
    pcm48k = np.concatenate([pcm48k, np.zeros(PACKET_SAMPLES + (-pcm48k.size) % PACKET_SAMPLES, np.int16)])
    return [encoder.encode(pcm48k[i : i + PACKET_SAMPLES]) for i in range(0, pcm48k.size, PACKET_SAMPLES)]


class EncodedClip(NamedTuple):
    """A clip's packets as a browser sends them, with silence around them."""

    packets: tuple[bytes, ...]  # without DTX: one every 20 ms
    dtx: tuple[bytes | None, ...]  # with DTX (the server asks for it): None where nothing is sent


@functools.cache
def silence_packet() -> bytes:
    """One packet of digital silence, as the encoder sends it once settled."""
    return opus_packets(np.zeros(RATE // 2, np.int16))[-2]


@functools.cache
def dtx_silence() -> tuple[bytes | None, ...]:
    """A silent microphone under DTX, one period of it (~400 ms), starting after a DTX packet:
    nothing, then a comfort-noise update and the DTX packet that follows it."""
    sent = sent_as_browser(opus_packets(np.zeros(RATE * 3, np.int16), dtx=True))
    ends = [i for i in range(1, len(sent)) if sent[i] is not None and sent[i - 1] is not None and is_dtx(sent[i])]
    return tuple(sent[ends[-2] + 1 : ends[-1] + 1])


@functools.cache
def encoded_clips(frame_ms: int = LoadConfig.frame_ms) -> dict[str, EncodedClip]:
    """Every shipped clip by name, encoded once per process (a few tens of ms each): LEAD_PACKETS
    of silence, the clip, then silence (under DTX, long enough for the encoder to go quiet)."""
    pad = lambda n: np.zeros(n * int(RATE * PACKET_S), np.int16)  # noqa: E731
    out = {}
    for clip in load_clips(frame_ms):
        pcm = np.frombuffer(clip.pcm, "<i2")
        dtx = sent_as_browser(opus_packets(np.concatenate([pad(LEAD_PACKETS), pcm, pad(DTX_TAIL_PACKETS)]), dtx=True))
        while dtx and dtx[-1] is None:  # the clip ends with its DTX packet: dtx_silence() goes on from there
            dtx.pop()
        out[clip.name] = EncodedClip(tuple(opus_packets(np.concatenate([pad(LEAD_PACKETS), pcm, pad(TAIL_PACKETS)]))), tuple(dtx))
    return out


class PacketClock:
    """Ticks every PACKET_S on one grid for the whole process; tracks wait for a tick."""

    def __init__(self, on_lag: Callable[[float], None] = lambda seconds: None, packet_s: float = PACKET_S) -> None:
        self.packet_s = packet_s
        self.on_lag = on_lag
        self._begin: float | None = None
        self._waiting: dict[int, list[asyncio.Future]] = {}
        self._task: asyncio.Task | None = None
        self._target: int | None = None  # the tick the timer sleeps for

    def now(self) -> int:
        """The current tick (the grid starts at the clock's first use)."""
        loop = asyncio.get_running_loop()
        if self._begin is None:
            self._begin = loop.time()
        return int((loop.time() - self._begin) / self.packet_s)

    async def wait(self, tick: int) -> None:
        """Returns at `tick` (at once when it is past)."""
        if tick <= self.now():
            return
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.setdefault(tick, []).append(future)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        elif self._target is not None and tick < self._target:  # due before what the timer sleeps for
            self._task.cancel()
            self._task = loop.create_task(self._run())
        await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._begin is not None
        while self._waiting:
            self._target = min(self._waiting)
            delay = self._begin + self._target * self.packet_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -self.packet_s:
                self.on_lag(-delay)
            due = self.now()
            for tick in [t for t in self._waiting if t <= due]:
                for future in self._waiting.pop(tick):
                    if not future.done():  # its track may have been cancelled
                        future.set_result(None)
        self._target = None


class Timetable:
    """Counts a student's clips as its audio is handed to the sender: a clip starts when the
    audio passes its start, and is sent once all of it has gone out."""

    def __init__(self, turns: list[Turn], hooks: PlayHooks) -> None:
        self.turns = turns
        self.hooks = hooks
        self.student_id = ""  # the server's, set once the offer is answered (before any audio)
        self._next = 0
        self._started = False

    def advance(self, media_s: float) -> None:
        """The stream's first `media_s` seconds are out."""
        while self._next < len(self.turns):
            turn = self.turns[self._next]
            if not self._started and media_s > turn.start_s + 1e-6:
                self._started = True
                self.hooks.clip_started(self.student_id, turn.clip.onset_s)
            if self._started and media_s >= turn.end_s - 1e-6:
                self._started = False
                self._next += 1
                self.hooks.clip_sent(self.student_id, turn.clip.text)
                continue
            return

    @property
    def unsent(self) -> int:
        """Clips of the plan not (completely) sent."""
        return len(self.turns) - self._next


class _StudentTrack(MediaStreamTrack):
    """A simulated student's microphone: its clips counted by a Timetable as the audio goes out;
    `finished` is set when the track ends (all sent, or aiortc stopped it: the connection closed)."""

    kind = "audio"

    def __init__(self, turns: list[Turn], hooks: PlayHooks) -> None:
        super().__init__()
        self.timetable = Timetable(turns, hooks)
        self.finished = asyncio.Event()

    @property
    def student_id(self) -> str:
        return self.timetable.student_id

    @student_id.setter
    def student_id(self, value: str) -> None:
        self.timetable.student_id = value

    def stop(self) -> None:
        super().stop()
        self.finished.set()


class FastRtp:
    """A student's packets sent straight from its track: the RTP header packed here, SRTP by
    aiortc's own session for the peer, out of the nominated ICE pair's socket at once. aiortc's
    sender would build an RtpPacket with three header extensions and pass it through two
    coroutines for every packet: at 2,000 students that costs the simulator a third of the host's
    cores, on the cores the server under test runs on. Its sender reports: BrowserReports.
    Reads aiortc internals: the names in AIORTC_SENDER_INTERNALS (tests/test_loadsim_webrtc.py)."""

    def __init__(self, sender, payload_type: int) -> None:  # noqa: ANN001 - aiortc's RTCRtpSender
        dtls = sender.transport
        self._srtp = dtls._tx_srtp
        self._connection = dtls.transport._connection
        self._ssrc = sender._ssrc
        self._pt = payload_type & 0x7F
        self._seq, self._ts = random.getrandbits(16), random.getrandbits(32)
        self._sent = 0  # sequence numbers count the packets sent; under DTX fewer than the stream's 20 ms steps
        self.octets = 0  # payload bytes sent, the last packet's RTP timestamp and when: for the sender reports
        self.last_ts, self.last_at = self._ts, time.time()

    def send(self, index: int, payload: bytes) -> None:
        """Packet `index` (its 20 ms step) of the stream (ConnectionError once the connection is gone)."""
        pair = self._connection._nominated.get(1)
        transport = pair.protocol.transport if pair is not None else None
        if transport is None or transport.is_closing():
            raise ConnectionError("the student's ICE connection is closed")
        self.last_ts, self.last_at = (self._ts + index * PACKET_SAMPLES) & 0xFFFFFFFF, time.time()
        header = _RTP_HEADER.pack(0x80, self._pt, (self._seq + self._sent) & 0xFFFF, self.last_ts, self._ssrc)
        transport.sendto(self._srtp.protect(header + payload), pair.remote_addr)
        self._sent += 1
        self.octets += len(payload)

    @property
    def packets(self) -> int:
        return self._sent


class BrowserReports(RTCRtpSender):
    """aiortc's sender of a simulated student, its RTCP as a browser's audio sender sends it:
    a sender report with the student's CNAME at an audio sender's pace (rtp_audio.send_audio_rtcp,
    as the gateway's receiver reports), where aiortc reports every 0.5-1.5 s, so that a gateway
    handles as many reports as browsers send it; the reports count what FastRtp sent (aiortc's
    own counters see none of it). A BYE at the end, as aiortc sends. Installed by
    OpusPlanTrack.bind() before the sender starts."""

    fast: FastRtp | None = None

    async def _run_rtcp(self) -> None:
        """Until cancelled (aiortc's stop() waits for the two events, whatever happens here)."""
        try:
            await send_audio_rtcp(self._RTCRtpSender__rtcp_started, lambda: self._send_rtcp(self._report()),
                                  "a simulated student's sender report")
        finally:
            try:
                await self._send_rtcp([RtcpByePacket(sources=[self._ssrc])])
            except Exception:  # noqa: BLE001 - the gateway then sees the stream end by its transport
                log.debug("a simulated student's BYE was not sent", exc_info=True)
            finally:
                self._RTCRtpSender__rtcp_exited.set()

    def _report(self) -> list:
        """A sender report (its NTP and RTP times of one moment, as RFC 3550 asks) and the CNAME;
        the report's time is kept for the round-trip time the gateway's next report gives."""
        fast, now = self.fast, time.time()
        ntp = current_ntp_time()
        rtp_now = (fast.last_ts + int((now - fast.last_at) * OPUS_RATE)) & 0xFFFFFFFF if fast else 0
        info = RtcpSenderInfo(ntp_timestamp=ntp, rtp_timestamp=rtp_now,
                              packet_count=fast.packets & 0xFFFFFFFF if fast else 0,
                              octet_count=fast.octets & 0xFFFFFFFF if fast else 0)
        self._RTCRtpSender__lsr, self._RTCRtpSender__lsr_time = (ntp >> 16) & 0xFFFFFFFF, now
        cname = self._RTCRtpSender__cname
        sdes = [RtcpSdesPacket(chunks=[RtcpSourceInfo(ssrc=self._ssrc, items=[(1, cname.encode())])])] if cname else []
        return [RtcpSrPacket(ssrc=self._ssrc, sender_info=info), *sdes]


_RTP_HEADER = struct.Struct("!BBHLL")
# (class, attribute) of aiortc and aioice that FastRtp reads (instance attributes: the test checks
# them on a connected peer).
AIORTC_SENDER_INTERNALS = ("RTCRtpSender._ssrc", "RTCRtpSender.transport", "RTCDtlsTransport._tx_srtp",
                           "RTCIceTransport._connection", "Connection._nominated", "CandidatePair.protocol",
                           "CandidatePair.remote_addr", "StunProtocol.transport", "RTCRtpTransceiver._codecs",
                           "RTCRtpSender._RTCRtpSender__rtcp_started", "RTCRtpSender._RTCRtpSender__rtcp_exited",
                           "RTCRtpSender._RTCRtpSender__cname", "RTCRtpSender._send_rtcp",
                           "RTCRtpSender._RTCRtpSender__lsr", "RTCRtpSender._RTCRtpSender__lsr_time",
                           "RTCRtpSender._RTCRtpSender__started")


class OpusPlanTrack(_StudentTrack):
    """A student's microphone: its turn-taking plan as pre-encoded Opus packets, one per tick.

    The plan is drawn when aiortc asks for the first packet (the connection is up then), for the
    time left until `end` (epoch seconds): `planner(length_s)` returns the turns, which start after
    `lead_s` of silence. The track ends after its last packet. use_dtx(), before the plan, makes it
    send as a browser does when the server asks for DTX: almost nothing in silence."""

    def __init__(self, clock: PacketClock, planner: Callable[[float], list[Turn]], end: float, hooks: PlayHooks,
                 lead_s: float = 0.5, clips: dict[str, EncodedClip] | None = None) -> None:
        super().__init__([], hooks)
        self.clock = clock
        self.planner = planner
        self.end = end
        self.lead_s = lead_s
        self.sent = 0  # the stream's 20 ms steps gone out (a packet handed to the sender, or none under DTX)
        self.total: int | None = None  # packets in the stream, once planned
        self._clips = clips if clips is not None else encoded_clips()
        self.dtx = False
        self._silence = silence_packet()
        self._quiet_from = 0  # where the silence being sent began (the end of the last clip's packets)
        self._blocks: list[tuple[int, tuple[bytes | None, ...]]] = []  # (first packet index, packets), in order
        self._block = 0
        self._first_tick = 0
        self._step = 1  # clock ticks per packet
        self._fast: Callable[[], FastRtp] | None = None

    def bind(self, pc) -> None:  # noqa: ANN001 - aiortc's RTCPeerConnection, this track added to it
        """Send this track's packets with FastRtp over `pc` rather than through aiortc's sender."""
        transceiver = next(t for t in pc.getTransceivers() if t.sender.track is self)
        sender = transceiver.sender
        if type(sender) is RTCRtpSender:  # its RTCP loop is BrowserReports' once it starts
            if sender._RTCRtpSender__started:
                raise ValueError("bind() takes a track whose sender has not started")
            sender.__class__ = BrowserReports

        def fast() -> FastRtp:
            made = FastRtp(sender, transceiver._codecs[0].payloadType)
            if isinstance(sender, BrowserReports):
                sender.fast = made
            return made

        self._fast = fast

    def use_dtx(self) -> None:
        """The server asked for DTX (its answer's `usedtx=1`: transport/dtx.py)."""
        self.dtx = True

    @property
    def complete(self) -> bool:
        return self.total is not None and self.sent >= self.total

    def _plan(self) -> None:
        length = max(0.0, self.end - time.time())
        turns = [Turn(t.start_s + self.lead_s, t.clip) for t in self.planner(max(0.0, length - self.lead_s))]
        self.timetable.turns = turns
        self.total = int(length / PACKET_S)
        for turn in turns:
            encoded = self._clips[turn.clip.name].dtx if self.dtx else self._clips[turn.clip.name].packets
            at = round(turn.start_s / PACKET_S) - LEAD_PACKETS
            if at < 0:  # the clip's leading silence would start before the stream: drop that much of it
                encoded, at = encoded[-at:], 0
            if self._blocks:  # blocks never overlap (gaps >= 1 s); if one did, its trailing silence gives way
                prev_at, prev = self._blocks[-1]
                self._blocks[-1] = (prev_at, prev[: max(0, at - prev_at)])
            self._blocks.append((at, encoded))
        # A clock finer than a packet (students.PHASES ticks per packet) spreads the students over
        # the 20 ms, as browsers' own clocks do: each track keeps a phase of its own.
        self._step = max(1, round(PACKET_S / self.clock.packet_s))
        self._first_tick = self.clock.now() + 1 + random.randrange(self._step)

    def _payload(self, index: int) -> bytes | None:
        """Packet `index` of the stream; None: nothing is sent for it (DTX)."""
        while self._block < len(self._blocks):
            at, packets = self._blocks[self._block]
            if index < at:
                break
            if index < at + len(packets):
                return packets[index - at]
            self._block += 1
            self._quiet_from = at + len(packets)
        if not self.dtx:
            return self._silence
        quiet = dtx_silence()
        return quiet[(index - self._quiet_from) % len(quiet)]

    async def recv(self) -> av.Packet:
        if self.readyState != "live":
            raise MediaStreamError
        if self.total is None:
            self._plan()
        assert self.total is not None
        if self._fast is not None:  # bound: aiortc's sender waits here while FastRtp sends all
            await self._send_all(self._fast())
        while True:
            if self.sent >= self.total:
                self.stop()
                raise MediaStreamError
            await self.clock.wait(self._first_tick + self.sent * self._step)
            index, payload = self.sent, self._payload(self.sent)
            self.sent += 1
            self.timetable.advance(self.sent * PACKET_S)
            if payload is not None:
                packet = av.Packet(payload)
                packet.pts, packet.time_base = index * PACKET_SAMPLES, TIME_BASE
                return packet


    async def _send_all(self, fast: FastRtp) -> None:
        assert self.total is not None
        try:
            while self.sent < self.total and self.readyState == "live":
                await self.clock.wait(self._first_tick + self.sent * self._step)
                if (payload := self._payload(self.sent)) is not None:
                    fast.send(self.sent, payload)
                self.sent += 1
                self.timetable.advance(self.sent * PACKET_S)
        except (ConnectionError, OSError):
            pass  # the connection closed: the clips not sent are counted unsent
        self.stop()
        raise MediaStreamError


class TimedTrack(_StudentTrack):
    """Another track (aiortc's MediaPlayer: it encodes for each student) with its clips counted
    as its frames are handed to the sender, and its lateness behind real time reported."""

    def __init__(self, inner: MediaStreamTrack, turns: list[Turn], hooks: PlayHooks) -> None:
        super().__init__(turns, hooks)
        self.inner = inner
        self.hooks = hooks
        self.ended_by_source = False
        self._t0: float | None = None

    @property
    def complete(self) -> bool:
        return self.ended_by_source

    async def recv(self) -> av.AudioFrame:
        try:
            frame = await self.inner.recv()
        except MediaStreamError:
            self.ended_by_source = True
            self.stop()
            raise
        media_end = float(frame.time) + frame.samples / frame.sample_rate
        now = time.time()
        if self._t0 is None:
            self._t0 = now - float(frame.time)
        if (late := now - (self._t0 + float(frame.time))) > PACKET_S:
            self.hooks.lag(late)
        self.timetable.advance(media_end)
        return frame

    def stop(self) -> None:
        super().stop()
        self.inner.stop()
