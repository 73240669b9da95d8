"""Discontinuous transmission (transport/dtx.py): the server asks for it, a silent sender sends
almost nothing, and the utterances cut from such a stream are those of the same audio sent
without it, ending as soon (the silence is filled in as the time passes, not when the next
packet comes ~400 ms later)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from fractions import Fraction

import aiohttp
import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from streamserver.loadsim.clients import Dashboard, create_room, join_student
from streamserver.loadsim.opus_encoder import sent_as_browser
from streamserver.loadsim.webrtc_student import dtx_silence, opus_packets
from streamserver.transport.dtx import ask_for_dtx, asks_for_dtx, is_dtx
from streamserver.transport.rtp_audio import TICKS_PER_SAMPLE, Reorder
from tests.test_webrtc_same_results import FRAME, RATE, boundaries, fed_to_vad, over_ws, serving
from tests.takers import PcmList

ADMIN = "dtx-admin"
HANGOVER_S = 0.5  # the default


def test_the_answer_asks_for_dtx_and_fec_on_opus_only():
    sdp = "\r\n".join(["v=0", "m=audio 9 UDP/TLS/RTP/SAVPF 96 0", "a=rtpmap:96 opus/48000/2", "a=rtpmap:0 PCMU/8000", ""])
    asked = ask_for_dtx(sdp)
    assert "a=rtpmap:96 opus/48000/2\r\na=fmtp:96 usedtx=1;useinbandfec=1\r\n" in asked
    assert "a=fmtp:0" not in asked and asks_for_dtx(asked) and not asks_for_dtx(sdp)
    merged = ask_for_dtx(sdp.replace("a=rtpmap:0 PCMU/8000", "a=fmtp:96 minptime=10;usedtx=0"))
    assert "a=fmtp:96 minptime=10;usedtx=1;useinbandfec=1" in merged and merged.count("a=fmtp:96") == 1


def test_a_silent_browser_sends_a_packet_in_ten():
    slots = opus_packets(np.zeros(RATE * 4, np.int16), dtx=True)
    sent = sent_as_browser(slots)
    assert all(len(p) > 2 for p in sent[:10])  # libopus codes the first quiet frames before going quiet
    assert sent[10] is not None and is_dtx(sent[10]) and sent[11] is None  # the DTX packet, then nothing
    assert sum(p is not None for p in sent[10:]) <= len(sent[10:]) / 9  # 2 packets in ~400 ms
    quiet = dtx_silence()
    assert quiet[0] is None and quiet[-1] is not None and is_dtx(quiet[-1]) and 15 <= len(quiet) <= 25


def test_a_packet_held_for_a_loss_is_played_when_silence_is_due():
    """Under DTX the HOLD packets that would give a loss up may be a second away: the sweep
    plays what is held (the loss concealed) before it fills the silence."""
    out = PcmList()
    reorder = Reorder(out)
    packets = opus_packets(np.zeros(RATE, np.int16))
    reorder.add(1, 0, packets[0])
    reorder.add(3, 960 * 2, packets[2])  # 2 is lost: 3 is held
    assert sum(p.size for p in out) == 320
    reorder.fill_silence(960 * 10)
    assert sum(p.size for p in out) == 320 * 10  # 2 concealed, 3 played, then silence to 200 ms


def test_audio_over_silence_filled_early_is_not_played_twice():
    """A packet late past the sweep's margin lands on silence already handed on: the overlap is
    dropped, so the stream stays as long as the time it covers."""
    out = PcmList()
    reorder = Reorder(out)
    packets = opus_packets(np.zeros(RATE, np.int16))
    reorder.add(1, 0, packets[0])
    reorder.fill_silence(960 * 6)  # to 120 ms
    reorder.add(2, 960 * 5, packets[1])  # 100-120 ms: all of it overlaps
    assert sum(p.size for p in out) == 320 * 6
    reorder.add(3, 960 * 5 + 480, packets[2])  # 110-130 ms: half of it is new
    assert sum(p.size for p in out) == 320 * 6 + 160 and reorder.end_ts == 960 * 6 + 480


def test_silence_filled_early_is_not_filled_again():
    out = PcmList()
    reorder = Reorder(out)
    packets = opus_packets(np.zeros(RATE, np.int16))
    reorder.add(1, 0, packets[0])  # 20 ms
    reorder.fill_silence(960 * 5)  # silence up to 100 ms, before the next packet
    reorder.add(2, 960 * 10, packets[1])  # the next packet, at 200 ms
    assert sum(p.size for p in out) == (960 * 11) // TICKS_PER_SAMPLE  # 220 ms: nothing twice, nothing missing
    reorder.add(3, 960 * 11, packets[2])
    reorder.fill_silence(960 * 11)  # nothing due: nothing added
    assert sum(p.size for p in out) == (960 * 12) // TICKS_PER_SAMPLE


class PacketsTrack(MediaStreamTrack):
    """Opus packets, one 20 ms step each in real time; None: nothing sent for that step."""

    kind = "audio"

    def __init__(self, packets: list[bytes | None]) -> None:
        super().__init__()
        self.packets, self._next, self._t0 = packets, 0, 0.0

    async def recv(self) -> av.Packet:
        while self._next < len(self.packets):
            i = self._next
            self._next += 1
            if i == 0:
                self._t0 = time.monotonic()
            await asyncio.sleep(max(0.0, self._t0 + i * 0.02 - time.monotonic()))
            if (payload := self.packets[i]) is not None:
                packet = av.Packet(payload)
                packet.pts, packet.time_base = i * 960, Fraction(1, 48000)
                return packet
        self.stop()
        raise MediaStreamError


def test_a_dtx_stream_cuts_the_same_utterances_as_soon(tiny_engine, librivox, monkeypatch):
    gap = np.zeros(int(1.5 * RATE), np.float32)
    speech = np.concatenate([np.zeros(RATE, np.float32), librivox[1][1], gap, librivox[4][1], gap])
    pcm = (np.clip(speech, -1, 1) * 32767).astype(np.int16)
    continuous, dtx = opus_packets(pcm), sent_as_browser(opus_packets(pcm, dtx=True))
    assert sum(p is None for p in dtx) > 0.7 * (1 + 1.5 + 1.5) / 0.02  # most of the 4 s of silence is not sent
    # In each gap nothing after the DTX packet (no comfort-noise update either): only the silence
    # sweep can end the utterance before the next clip's first packet, 1.5 s on.
    quiet = np.abs(pcm.astype(np.int32)).reshape(-1, 320).max(axis=1) == 0  # per 20 ms packet
    for i in range(1, len(dtx)):
        if i < quiet.size and quiet[i] and dtx[i] is not None and not is_dtx(dtx[i]) and any(
                p is not None and is_dtx(p) for p in dtx[max(0, i - 25):i]):
            dtx[i] = None

    streams = fed_to_vad(monkeypatch)
    cut: dict[str, list] = defaultdict(list)
    waited: dict[str, list[float]] = defaultdict(list)  # end of speech -> utterance cut, seconds

    async def body() -> list[dict]:
        def timed(utterance) -> None:  # noqa: ANN001 - an Utterance
            waited[utterance.student_name].append(time.time() - utterance.end_of_speech_ts)

        async with serving(tiny_engine, ADMIN, cut, timed) as (url, _):
            async with aiohttp.ClientSession() as s:
                room = await create_room(s, url, ADMIN, "dtx")
                dashboard = await Dashboard().open(s, url, room)
                track = PacketsTrack(dtx)
                student = await join_student(s, url, room, "webrtc-dtx", track)
                await over_ws(s, url, room, "ws-opus", continuous, "opus")
                while track.readyState == "live":
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.5)
                await student.close()
                for _ in range(300):
                    if len(dashboard.transcripts()) >= 4:
                        break
                    await asyncio.sleep(0.1)
                await dashboard.close()
                return dashboard.transcripts()

    transcripts = asyncio.run(asyncio.wait_for(body(), 120))
    assert sorted(cut) == ["webrtc-dtx", "ws-opus"] and all(len(cut[n]) == 2 for n in cut), {n: len(u) for n, u in cut.items()}
    fed = {name: np.concatenate(chunks) for name, chunks in streams.items()}
    cuts = {name: [boundaries(fed[name], u.audio) for u in cut[name]] for name in cut}
    print(cuts, dict(waited))
    assert all(abs(a - b) <= FRAME and abs(c - d) <= FRAME for (a, c), (b, d) in zip(cuts["webrtc-dtx"], cuts["ws-opus"])), cuts
    text = {name: [t["text"] for t in sorted((t for t in transcripts if t["student_name"] == name), key=lambda t: t["start_ts"])]
            for name in cut}
    assert text["webrtc-dtx"] == text["ws-opus"] and all(len(t.split()) >= 5 for t in text["ws-opus"]), text
    # Cut after the hangover and the sweep's margin, not when the next packet came (up to 400 ms on).
    assert all(w < HANGOVER_S + 0.2 for w in waited["webrtc-dtx"]), waited
