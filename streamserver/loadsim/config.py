"""What one load-simulation run is asked to do, and the defaults of `streamserver loadsim`'s
options (cli.py reads them here, without loading the client stack)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class LoadConfig:
    urls: list[str]  # one server, or gateways: rooms are spread over them, students go to their room's
    students: int
    duration_s: float
    admin_token: str
    speak_ratio: float = 0.1
    transport: str = "ws"  # or "webrtc": every student over WebRTC
    webrtc_students: int = 0  # with transport "ws": this many of them over WebRTC instead
    webrtc_client: str = "packets"  # students.WEBRTC_CLIENTS: pre-encoded Opus packets, or aiortc's MediaPlayer (encodes)
    rooms: int = 1
    language: str = "en"
    # WebSocket message length: the gateway's and the client's cost goes per message, not per
    # second of audio (about half at 60 ms against 20 ms: benchmarks/README.md, "WebSocket cost per
    # student"), while the end of speech reaches the VAD up to one message later (finals p99 about
    # 60 ms later at 100 ms messages than at 20 ms).
    frame_ms: int = 60
    seed: int = 0
    drain_s: float = 30.0  # the longest wait for transcripts still due at the end
    processes: int = 1  # students spread over this many child processes (child.py); 1: in this one
    keep_audio: bool = True  # WebSocket students keep their audio and send it again after a break, as the page

    def settings(self) -> dict[str, Any]:
        """What the report repeats of the run's configuration (never the admin token)."""
        keep = ("urls", "students", "rooms", "transport", "webrtc_students", "webrtc_client", "speak_ratio", "language", "frame_ms", "seed", "processes",
                "keep_audio")
        return {"duration_s": self.duration_s, **{k: v for k, v in asdict(self).items() if k in keep}}
