"""Discontinuous transmission (DTX): a silent student sends almost no packets, and the silence
that ends an utterance is still heard on time.

The server's answer asks the browser for DTX (`usedtx=1` on the Opus line, RFC 7587) and for
in-band FEC (`useinbandfec=1`: the receiver conceals a lost packet from the next one). In
silence a browser's Opus encoder then codes one frame in 20 (a comfort-noise update every
400 ms); libwebrtc sends it and the first empty frame after it (a packet of at most DTX_BYTES:
the TOC byte alone), and nothing else until the next one, or until the student speaks. A class
is mostly silent students, so most of a gateway's packets (and their decryption, decoding and
VAD) go away.

The RTP timestamps still count the silence, so the receiver (rtp_audio.Reorder) fills the gap
with silence when the next packet comes. That would end an utterance up to 400 ms late, so
while a student's utterance is open (its hangover runs) SilenceSweep fills the silence of a
stream in DTX as the time passes, one timer per event loop, SWEEP_S apart and MARGIN_S behind
the clock (a packet delayed by jitter less than that still finds its place free; one that is
later has the overlap dropped). A lost DTX packet is not noticed: that silence then comes with
the next packet, up to ~400 ms later.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from typing import Protocol

log = logging.getLogger(__name__)
DTX_BYTES = 2  # an Opus packet this short carries no audio (libwebrtc's own test for a DTX frame)
SWEEP_S = 0.02
MARGIN_S = 0.04
FRAME_S = 0.02  # a browser's Opus frame: what a packet holds
OPUS_PARAMETERS = {"usedtx": "1", "useinbandfec": "1"}
_OPUS_RTPMAP = re.compile(r"a=rtpmap:(\d+) opus/", re.IGNORECASE)
_FMTP = re.compile(r"a=fmtp:(\d+) (.*)")


def is_dtx(payload: bytes) -> bool:
    return len(payload) <= DTX_BYTES


def ask_for_dtx(sdp: str) -> str:
    """An answer's SDP with OPUS_PARAMETERS on each Opus payload type's fmtp line (added, or
    merged into the one there): what the browser's encoder reads from the remote description."""
    lines = sdp.split("\r\n")
    opus = {m.group(1) for line in lines if (m := _OPUS_RTPMAP.match(line))}
    with_fmtp = {m.group(1) for line in lines if (m := _FMTP.match(line)) and m.group(1) in opus}
    out: list[str] = []
    for line in lines:
        if (m := _FMTP.match(line)) and m.group(1) in opus:
            params = dict(p.split("=", 1) for p in m.group(2).split(";") if "=" in p)
            line = _fmtp_line(m.group(1), {**params, **OPUS_PARAMETERS})
        out.append(line)
        if (m := _OPUS_RTPMAP.match(line)) and m.group(1) not in with_fmtp:
            out.append(_fmtp_line(m.group(1), OPUS_PARAMETERS))
    return "\r\n".join(out)


def _fmtp_line(payload_type: str, params: dict[str, str]) -> str:
    return f"a=fmtp:{payload_type} " + ";".join(f"{k}={v}" for k, v in params.items())


def asks_for_dtx(sdp: str) -> bool:
    """Whether a remote description asks this side's Opus encoder for DTX."""
    return re.search(r"^a=fmtp:\d+ .*\busedtx=1\b", sdp, re.MULTILINE) is not None


class Silent(Protocol):
    """A stream the sweep fills (rtp_audio.AudioReceiver)."""

    def fill_silence(self, now: float) -> bool:
        """Fill the silence due by `now` (monotonic); False: no longer to be swept."""
        ...


class SilenceSweep:
    """The streams in DTX with an utterance open, filled every SWEEP_S by one timer."""

    def __init__(self) -> None:
        self._streams: set[Silent] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, stream: Silent) -> None:
        self._streams.add(stream)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        now = time.monotonic()
        for stream in list(self._streams):
            try:
                keep = stream.fill_silence(now)
            except Exception:  # noqa: BLE001 - one stream's failure is its own: the sweep goes on
                log.exception("filling the silence of a DTX stream failed")
                keep = False
            if not keep:
                self._streams.discard(stream)
        if self._streams:
            self._timer = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)


_sweeps: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SilenceSweep] = weakref.WeakKeyDictionary()


def sweep() -> SilenceSweep:
    """The running event loop's sweep (one per loop: a timer lives on its loop)."""
    loop = asyncio.get_running_loop()
    found = _sweeps.get(loop)
    if found is None:
        found = _sweeps[loop] = SilenceSweep()
    return found
