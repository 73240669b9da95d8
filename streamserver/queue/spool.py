"""A durable local spool for utterances the job queue cannot take now (its Redis unreachable:
an on-prem gateway whose uplink is down).

Each utterance is one file, written to a temporary name, fsync'd and renamed, so that a gateway
killed at any moment leaves either the whole job or none of it; a restarted gateway finds the
files and queues them. File names sort in the order the utterances were spooled, and they are
queued in that order. A job spooled and also queued before a crash is published once all the
same: the queue's once-per-utterance guard (asr:done) sees to it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from streamserver.events import Utterance

_NAME = re.compile(r"^(\d{12})-[0-9a-f]{1,64}\.utt$")
_RESULT = re.compile(r"^(\d{12})-[0-9a-f]{1,64}\.result$")
_HEADER_FIELDS = ("utterance_id", "room_id", "student_id", "student_name", "language", "start_ts", "end_of_speech_ts", "cut",
                  "source")


class SpoolError(ValueError):
    """A spool file this version cannot read (it is set aside, never retried)."""


class Spool:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        numbers = [int(m.group(1)) for p in self.directory.iterdir() if (m := _NAME.match(p.name) or _RESULT.match(p.name))]
        self._next = max(numbers, default=0) + 1

    def pending(self) -> list[Path]:
        """Spooled jobs, oldest first."""
        return sorted(p for p in self.directory.iterdir() if _NAME.match(p.name))

    def put(self, u: Utterance) -> Path:
        """Write the utterance durably (blocking: call it off the event loop)."""
        header = json.dumps({name: getattr(u, name) for name in _HEADER_FIELDS}).encode()
        pcm = (np.clip(u.audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()
        return self._write(f"{u.utterance_id}.utt", len(header).to_bytes(4, "little") + header + pcm)

    # Results of the gateway's local fallback (asr/fallback.py) not yet in the central history:
    # kept here too, so that a gateway restarted during the outage still writes them there.
    def put_result(self, utterance_id: str, event_json: str) -> Path:
        return self._write(f"{utterance_id}.result", event_json.encode())

    def results(self) -> list[Path]:
        """Local results not yet written to the central history, oldest first."""
        return sorted(p for p in self.directory.iterdir() if _RESULT.match(p.name))

    @staticmethod
    def load_result(path: Path) -> str:
        return path.read_text()

    @staticmethod
    def utterance_id(path: Path) -> str:
        return path.name.split("-", 1)[1].rsplit(".", 1)[0]

    def _write(self, suffix: str, data: bytes) -> Path:
        path = self.directory / f"{self._next:012d}-{suffix}"
        self._next += 1
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power cut
        finally:
            os.close(directory)
        return path

    @staticmethod
    def load(path: Path) -> Utterance:
        data = path.read_bytes()
        try:
            size = int.from_bytes(data[:4], "little")
            header = json.loads(data[4 : 4 + size])
            audio = np.frombuffer(data[4 + size :], "<i2").astype(np.float32) / 32768.0
            return Utterance(audio=audio, **{name: header[name] for name in _HEADER_FIELDS if name in header})
        except (ValueError, KeyError, TypeError) as error:
            raise SpoolError(f"{path.name} is not a spooled utterance: {error!r}") from None

    @staticmethod
    def remove(path: Path) -> None:
        path.unlink(missing_ok=True)

    def set_aside(self, path: Path) -> None:
        path.rename(path.with_suffix(".bad"))
