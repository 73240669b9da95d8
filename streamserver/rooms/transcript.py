"""A class's transcript as the teacher exports it (GET /api/rooms/<id>/transcript): every final
of the class, in the order spoken, as JSON, CSV or plain text."""

from __future__ import annotations

import csv
import io
import json
import time

FORMATS = {"json": "application/json", "csv": "text/csv", "txt": "text/plain"}
CSV_COLUMNS = ("start_time", "end_of_speech_time", "student_name", "student_id", "text", "intent", "language", "utterance_id",
               "fallback", "recovered")


def finals(events_json: list[str]) -> list[dict]:
    """The transcripts, once each (by utterance), in the order spoken (start time)."""
    seen: dict[str, dict] = {}
    for raw in events_json:
        event = json.loads(raw)
        if event.get("type") == "transcript":
            seen.setdefault(event["utterance_id"], event)
    return sorted(seen.values(), key=lambda e: (e["start_ts"], e["end_of_speech_ts"]))


# A spreadsheet runs a cell that starts with one of these as a formula (=HYPERLINK(...) as a
# student's name): such a cell gets a leading apostrophe, which spreadsheets show as text.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _cell(text: str) -> str:
    """A free-text CSV cell (a name the student chose, a transcript) that no spreadsheet runs."""
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


def render(room: dict, transcripts: list[dict], fmt: str) -> str:
    """`room`: room_id and name. ValueError for a format not in FORMATS."""
    if fmt == "json":
        return json.dumps({"room_id": room["room_id"], "room_name": room["name"], "transcripts": transcripts},
                          ensure_ascii=False, indent=1)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(CSV_COLUMNS)
        for t in transcripts:
            writer.writerow([_iso(t["start_ts"]), _iso(t["end_of_speech_ts"]), _cell(t["student_name"]), t["student_id"], _cell(t["text"]),
                             (t.get("intent") or {}).get("label", ""), t["language"], t["utterance_id"],
                             int(bool(t.get("fallback"))), int(bool(t.get("recovered")))])
        return out.getvalue()
    if fmt == "txt":
        lines = [f"Class {room['name']} ({room['room_id']})", ""]
        lines += [f"[{time.strftime('%H:%M:%S', time.gmtime(t['start_ts']))} UTC] {t['student_name']}: {t['text']}"
                  + (" (recovered)" if t.get("recovered") else "") for t in transcripts]
        return "\n".join(lines) + "\n"
    raise ValueError(f"format must be one of {', '.join(FORMATS)}")
