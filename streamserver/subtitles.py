"""A class's transcript as subtitles (GET /api/rooms/<id>/transcript?format=srt|vtt): one cue per
final, in the order spoken, from its start to the end of its speech, each named by its speaker.

Cue times are seconds from an origin: the recording's start when the caller gives it (`origin`,
Unix seconds: the moment a recording of the class began), else the class's first speech. A video
player lays the file over a recording that starts at the origin. A cue that ends before the
origin is left out; one that starts before it starts at 0.
"""

from __future__ import annotations

import re

FORMATS = {"srt": "application/x-subrip", "vtt": "text/vtt"}

# Cue text is one line: a line break inside a cue ends it in both formats (an empty line), and
# names and transcripts carry no intended breaks.
_SPACE = re.compile(r"\s+")


def _one_line(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


def _clock(seconds: float, decimal: str) -> str:
    """HH:MM:SS,mmm (SRT) or HH:MM:SS.mmm (WebVTT); hours grow past 99 for a class that long."""
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


def _vtt_escape(text: str) -> str:
    # WebVTT cue text is markup: & and < start entities and tags, and > ends a voice's name (and
    # "-->" in a cue would read as timing).
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def cues(transcripts: list[dict], origin: float | None = None) -> list[tuple[float, float, str, str]]:
    """(start, end, speaker, text) in seconds from the origin, in the order of `transcripts`
    (transcript.finals: the order spoken)."""
    if not transcripts:
        return []
    zero = origin if origin is not None else min(t["start_ts"] for t in transcripts)
    out = []
    for t in transcripts:
        start, end = t["start_ts"] - zero, max(t["end_of_speech_ts"], t["start_ts"]) - zero
        if end < 0:
            continue
        out.append((max(0.0, start), end, _one_line(t["student_name"]), _one_line(t["text"])))
    return out


def render(transcripts: list[dict], fmt: str, origin: float | None = None) -> str:
    """SRT or WebVTT of the finals; ValueError for a format not in FORMATS."""
    timed = cues(transcripts, origin)
    if fmt == "srt":
        blocks = [f"{n}\n{_clock(start, ',')} --> {_clock(end, ',')}\n{speaker}: {text}\n"
                  for n, (start, end, speaker, text) in enumerate(timed, 1)]
        return "\n".join(blocks)
    if fmt == "vtt":
        # The voice span names the speaker as players and screen readers expect (<v Name>).
        blocks = [f"{_clock(start, '.')} --> {_clock(end, '.')}\n<v {_vtt_escape(speaker)}>{_vtt_escape(text)}</v>\n"
                  for start, end, speaker, text in timed]
        return "\n".join(["WEBVTT\n", *blocks])
    raise ValueError(f"format must be one of {', '.join(FORMATS)}")
