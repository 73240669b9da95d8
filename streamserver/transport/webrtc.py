"""WebRTC termination with aiortc: a student's SDP offer in, an answer out, 16 kHz PCM to a sink.

aiortc does no trickle ICE: the browser sends its offer after gathering completes, and our
answer carries all our candidates. Left alone, aiortc asks a public STUN server and aioice leaves
loopback out of its host candidates; both are set explicitly here (ICE servers, host addresses).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aioice.ice
from aiortc import (
    RTCConfiguration, RTCDataChannel, RTCIceServer, RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription,
)

from streamserver.audio.pacing import TooFast
from streamserver.stages import PcmTaker
from streamserver.transport import dtx, rtp_audio
from streamserver.transport.candidates import CandidatePolicy, TooManyCandidates, filter_offer

log = logging.getLogger(__name__)
for _noisy in ("aioice", "aiortc"):  # aioice logs every ICE check at INFO: lines per offer, per pair
    logging.getLogger(_noisy).setLevel(logging.WARNING)
_default_host_addresses = aioice.ice.get_host_addresses
_closing: set[asyncio.Task] = set()  # peers closing in the background (a task needs a reference until it is done)
UNDECODABLE = "undecodable"  # a data channel's event for a text message that is not UTF-8 (_text_must_decode)


class OfferError(ValueError):
    """The client's offer cannot be answered (the message says why)."""


def use_host_addresses(addresses: list[str]) -> None:
    """Gather host candidates on exactly these addresses; empty: every interface aioice finds plus
    loopback (which it leaves out, so a browser on the same machine could not connect).
    aioice has no option for it, so its lookup is replaced process-wide."""
    if addresses:
        aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: list(addresses)
    else:
        aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: [
            *_default_host_addresses(use_ipv4, use_ipv6), *(["127.0.0.1"] if use_ipv4 else [])
        ]


def ice_configuration(servers: list[dict]) -> RTCConfiguration:
    return RTCConfiguration(
        iceServers=[RTCIceServer(urls=s["urls"], username=s.get("username"), credential=s.get("credential")) for s in servers]
    )


def _opus_only() -> list:
    """aiortc's Opus capability: the one codec a student's audio may use (browsers send Opus; the
    receiver decodes nothing else)."""
    return [c for c in RTCRtpReceiver.getCapabilities("audio").codecs if c.mimeType.lower() == "audio/opus"]


def _text_must_decode(sctp) -> None:  # noqa: ANN001 - aiortc's RTCSctpTransport
    """aiortc decodes a data channel's text message as UTF-8 inside its SCTP transport: bytes that
    do not decode raise there, and the UnicodeDecodeError ends the peer's DTLS transport (its
    audio too) with a traceback in the log. Here such a message is the channel's UNDECODABLE
    event instead, for its owner to refuse as any message it cannot use; the rest of what the
    packet carried is handled as usual."""
    receive = sctp._data_channel_receive

    async def checked(stream_id: int, pp_id: int, data: bytes) -> None:
        try:
            await receive(stream_id, pp_id, data)
        except UnicodeDecodeError:
            channel = sctp._data_channels.get(stream_id)
            if channel is None:  # a channel's label or protocol: it never opens
                log.warning("refused a data channel whose name is not UTF-8")
                return
            try:
                channel.emit(UNDECODABLE)
            except Exception:  # noqa: BLE001 - raised here it would end the peer after all
                log.exception("refusing a data channel's message that is not UTF-8 failed")

    sctp._data_channel_receive = checked


def close_soon(pc: RTCPeerConnection, after_s: float = 0.0) -> None:
    """Close a peer in the background (after `after_s`); a failure is logged, never raised."""

    async def close() -> None:
        await asyncio.sleep(after_s)
        try:
            await pc.close()
        except Exception:  # noqa: BLE001 - the peer is going anyway; never the room
            log.exception("closing a WebRTC peer failed")

    task = asyncio.get_running_loop().create_task(close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)


async def answer(
    offer_sdp: str,
    ice_servers: list[dict],
    stream: PcmTaker,
    on_end: Callable[[], None],
    candidates: CandidatePolicy = CandidatePolicy(),
    on_channel: Callable[[RTCDataChannel], None] | None = None,
    utterance_open: Callable[[], bool] = lambda: False,
) -> tuple[RTCPeerConnection, str]:
    """Accept an audio offer; the student's audio goes to `stream` (the next stage: stages.py) as
    16 kHz mono int16 as its packets arrive (transport/rtp_audio.py), on_end once when it stops.
    The stream raising TooFast
    closes the peer. Only the offer's allowed ICE candidates are contacted (transport/candidates.py).
    A data channel the page opens goes to on_channel (transport/recovery.py). The answer asks the
    browser for DTX (transport/dtx.py); `utterance_open` tells the receiver when its silence is
    waited for."""
    if "m=audio" not in offer_sdp:
        raise OfferError("the offer has no audio")
    if "a=fingerprint:" not in offer_sdp:  # aiortc would answer, then fail in its DTLS task
        raise OfferError("the offer has no DTLS fingerprint (a=fingerprint)")
    try:
        offer_sdp = filter_offer(offer_sdp, candidates)
    except TooManyCandidates as error:
        raise OfferError(str(error)) from None
    pc = RTCPeerConnection(ice_configuration(ice_servers))
    # Made before the offer is applied, so that its first audio line lands on it: receive-only,
    # Opus only, its receiver decoding in the event loop.
    audio = pc.addTransceiver("audio", direction="recvonly")
    audio.setCodecPreferences(_opus_only())
    ended = False

    def finish() -> None:
        nonlocal ended
        if not ended:
            ended = True
            on_end()

    def refused(error: BaseException) -> None:
        if isinstance(error, TooFast):  # a peer sending faster than anyone speaks is cut off
            log.warning("closing a WebRTC peer: %s", error)
            receiver._enabled = False  # aiortc's own switch: later packets are dropped
            close_soon(pc)  # not awaited here: this runs in its transport
        else:  # a bad packet costs that packet, never the room
            log.error("dropping audio that could not be processed", exc_info=error)

    receiver = rtp_audio.install(audio.receiver, stream, finish, refused, utterance_open)

    @pc.on("datachannel")
    def on_datachannel(channel: RTCDataChannel) -> None:
        if on_channel is not None:
            on_channel(channel)
        else:
            channel.close()

    @pc.on("connectionstatechange")
    async def on_state() -> None:
        if pc.connectionState in ("failed", "closed"):
            await pc.close()
            finish()

    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        if pc.sctp is not None:
            _text_must_decode(pc.sctp)
        for other in pc.getTransceivers():  # video, a second audio track: answered, never received
            if other is not audio:
                other.direction = "inactive"
        await pc.setLocalDescription(await pc.createAnswer())
    except Exception as error:  # aiortc raises ValueError, KeyError ... on bad SDP
        await pc.close()
        # aiortc's own words where it has some; its internals' (an attribute, an index) say nothing to a client
        why = str(error) if isinstance(error, ValueError) and str(error) else "malformed or unsupported SDP"
        raise OfferError(f"cannot use this offer: {why}") from None
    return pc, dtx.ask_for_dtx(pc.localDescription.sdp)
