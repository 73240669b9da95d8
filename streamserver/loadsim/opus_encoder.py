"""A browser's Opus encoder for the simulated students: libopus itself (the library the server
decodes with, transport/rtp_audio.libopus), because FFmpeg's wrapper, all PyAV exposes, cannot
turn on discontinuous transmission (DTX).

With DTX (what the server's answer asks for: transport/dtx.py) libopus codes a frame of
silence as a packet of one byte, except a comfort-noise update every ~400 ms; libwebrtc sends
the first of a run of such packets and no other (sent_as_browser), so a silent student sends
about 5 packets a second instead of 50.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from streamserver.transport.dtx import is_dtx
from streamserver.transport.rtp_audio import libopus

APPLICATION_VOIP = 2048
SET_BITRATE = 4002
SET_DTX = 4016
MAX_PACKET = 1500


@functools.cache
def _encoder_lib() -> ctypes.CDLL:
    lib = libopus()
    if lib is None:
        raise RuntimeError("no libopus found (PyAV's wheel ships one; or install the system's libopus)")
    lib.opus_encoder_create.restype = ctypes.c_void_p
    lib.opus_encoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.opus_encode.restype = ctypes.c_int32
    lib.opus_encode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int32]
    lib.opus_encoder_ctl.restype = ctypes.c_int  # variadic: its arguments are passed as ctypes ints
    lib.opus_encoder_destroy.restype = None
    lib.opus_encoder_destroy.argtypes = [ctypes.c_void_p]
    return lib


class OpusEncoder:
    """Mono int16 frames in (of 2.5-60 ms at `rate`), one Opus packet out per frame."""

    def __init__(self, rate: int, bitrate: int, dtx: bool) -> None:
        lib = _encoder_lib()
        error = ctypes.c_int()
        self._lib = lib
        self._state = lib.opus_encoder_create(rate, 1, APPLICATION_VOIP, ctypes.byref(error))
        if error.value != 0 or not self._state:
            raise RuntimeError(f"opus_encoder_create failed ({error.value})")
        for request, value in ((SET_BITRATE, bitrate), (SET_DTX, int(dtx))):
            if lib.opus_encoder_ctl(ctypes.c_void_p(self._state), ctypes.c_int(request), ctypes.c_int(value)) != 0:
                raise RuntimeError(f"opus_encoder_ctl({request}, {value}) failed")
        self._out = ctypes.create_string_buffer(MAX_PACKET)

    def encode(self, frame: np.ndarray) -> bytes:
        pcm = np.ascontiguousarray(frame, dtype=np.int16)
        n = self._lib.opus_encode(self._state, pcm.ctypes.data, pcm.size, self._out, MAX_PACKET)
        if n < 0:
            raise RuntimeError(f"opus_encode failed ({n})")
        return self._out.raw[:n]

    def __del__(self) -> None:
        if getattr(self, "_state", None):
            self._lib.opus_encoder_destroy(self._state)
            self._state = None


def sent_as_browser(packets: list[bytes]) -> list[bytes | None]:
    """What libwebrtc sends of an encoder's packets: of a run of empty (DTX) packets only the
    first, which tells the receiver that silence follows; None for a packet not sent."""
    out: list[bytes | None] = []
    for i, packet in enumerate(packets):
        out.append(None if is_dtx(packet) and i > 0 and is_dtx(packets[i - 1]) else packet)
    return out
