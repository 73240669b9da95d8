"""WebRTC termination with aiortc: a student's SDP offer in, an answer out, audio frames to a sink.

aiortc does no trickle ICE: the browser sends its offer after gathering completes, and our
answer carries all our candidates. Left alone, aiortc asks a public STUN server and aioice leaves
loopback out of its host candidates; both are set explicitly here (ICE servers, host addresses).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from streamserver.audio.pacing import TooFast
from streamserver.transport.candidates import CandidatePolicy, TooManyCandidates, filter_offer

log = logging.getLogger(__name__)
for _noisy in ("aioice", "aiortc"):  # aioice logs every ICE check at INFO: lines per offer, per pair
    logging.getLogger(_noisy).setLevel(logging.WARNING)
_default_host_addresses = aioice.ice.get_host_addresses


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


async def answer(
    offer_sdp: str,
    ice_servers: list[dict],
    on_frame: Callable[[object], None],
    on_end: Callable[[], None],
    candidates: CandidatePolicy = CandidatePolicy(),
) -> tuple[RTCPeerConnection, str]:
    """Accept an audio offer; every received frame goes to on_frame, on_end when it stops.
    Only the offer's allowed ICE candidates are contacted (transport/candidates.py)."""
    if "m=audio" not in offer_sdp:
        raise OfferError("the offer has no audio")
    try:
        offer_sdp = filter_offer(offer_sdp, candidates)
    except TooManyCandidates as error:
        raise OfferError(str(error)) from None
    pc = RTCPeerConnection(ice_configuration(ice_servers))
    ended = False
    # Kept, and cancelled with the peer: a pump whose track never delivers (a peer closed before
    # its receiver started) would otherwise wait forever.
    pumps: set[asyncio.Task] = set()

    def finish() -> None:
        nonlocal ended
        if not ended:
            ended = True
            on_end()

    def stop_pumps() -> None:
        for task in pumps:
            if task is not asyncio.current_task():
                task.cancel()

    @pc.on("track")
    def on_track(track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            task = asyncio.get_running_loop().create_task(_pump(track, on_frame, finish, pc))
            pumps.add(task)
            task.add_done_callback(pumps.discard)

    @pc.on("connectionstatechange")
    async def on_state() -> None:
        if pc.connectionState in ("failed", "closed"):
            await pc.close()
            stop_pumps()
            finish()

    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        await pc.setLocalDescription(await pc.createAnswer())
    except Exception as error:  # aiortc raises ValueError, KeyError ... on bad SDP
        await pc.close()
        stop_pumps()
        raise OfferError(f"cannot use this offer: {error or type(error).__name__}") from None
    return pc, pc.localDescription.sdp


async def _pump(track: MediaStreamTrack, on_frame: Callable[[object], None], on_end: Callable[[], None],
                pc: RTCPeerConnection) -> None:
    try:
        while True:
            frame = await track.recv()
            try:
                on_frame(frame)
            except TooFast as error:  # a peer sending faster than anyone speaks is cut off
                log.warning("closing a WebRTC peer: %s", error)
                await pc.close()
                return
            except Exception:  # a bad frame costs that frame, never the room
                log.exception("dropping an audio frame that could not be processed")
    except MediaStreamError:
        pass
    finally:
        on_end()
