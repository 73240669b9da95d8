"""A student joining over WebRTC: its seat (classroom.py), its offer answered with its audio
wired to a StudentAudio (transport/webrtc.py), and for a page that keeps its audio, its recovery
channel (transport/recovery.py) and where its queued utterances lie (rooms/parking.py)."""

from __future__ import annotations

from typing import Callable

from streamserver.audio.pipeline import StudentAudio
from streamserver.classroom import Classroom
from streamserver.rooms.admission import AddressLimits
from streamserver.rooms.connections import Connection
from streamserver.rooms.registry import Room
from streamserver.stages import PcmTaker
from streamserver.transport import recovery, webrtc


async def connect_student(classroom: Classroom, room: Room, student_id: str, name: str, offer_sdp: str, address: str,
                          limits: AddressLimits = AddressLimits(), keeps: dict | None = None, resumed: bool = False,
                          watch: Callable[[StudentAudio], PcmTaker] = lambda audio: audio, source: str = "") -> str:
    """Answer a student's offer: the answer. A reconnect replaces the old peer and keeps the
    identity. `keeps`: the page keeps its audio ({"catch_up": bool, "clock": name}: it will send
    what was not acknowledged); `resumed`: it proved its identity (rooms/identity.py); `watch`:
    what the peer's audio passes through on its way to the pipeline (rooms/idle.py); `source` as
    Classroom.join's. Raises
    OfferError, and as Classroom.open_stream."""
    catch_up = bool(keeps and keeps.get("catch_up"))
    audio, new = await classroom.join(room, student_id, name, address, limits, catch_up, resumed, source)
    settings = classroom.settings
    try:
        if keeps is not None:
            audio.keep(catch_up, clock=str(keeps.get("clock") or ""))
            if catch_up:
                audio.already_sent(await classroom.parking.sent_before(room.room_id, student_id, audio.stream_clock))

        def on_channel(channel) -> None:  # noqa: ANN001 - aiortc's RTCDataChannel
            connection = classroom.connections.get((room.room_id, student_id))
            if channel.label != recovery.LABEL or not audio.kept or connection is None or connection.audio is not audio:
                channel.close()
                return
            connection.tell = recovery.teller(recovery.attach(channel, audio, classroom.pacer))  # a catch-up's own pace

        pc, answer_sdp = await webrtc.answer(offer_sdp, settings.ice_servers, watch(audio), lambda: classroom.close_stream(room, student_id, audio),
                                             classroom.candidates, on_channel, lambda: audio.utterance_open)
    except BaseException:
        await classroom.not_joined(room, student_id, new)
        raise
    connection = Connection(lambda reason, code: recovery.end_peer(pc, connection.tell, reason, code), audio, address)
    await classroom.joined(room, student_id, connection, new)
    return answer_sdp
