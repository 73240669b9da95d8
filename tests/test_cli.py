"""`streamserver transcribe` as a user runs it: real files, real weights, a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import LIBRIVOX


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamserver", "transcribe", "--threads", "2", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_json_lines_for_good_files_and_clear_errors_for_bad_ones(tmp_path: Path):
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    not_audio = tmp_path / "notes.wav"
    not_audio.write_text("this is not audio\n" * 50)
    missing = tmp_path / "missing.wav"
    good = [str(p) for p in LIBRIVOX[:2]]
    proc = _run("--json", good[0], str(missing), str(not_audio), str(empty), good[1])
    assert proc.returncode == 1
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["file"] for r in lines] == good  # the good files around the bad ones still ran
    for record in lines:
        assert record["language"] == "en" and record["text"] and record["latency_ms"] > 0
    for bad in (missing, not_audio, empty):
        assert str(bad) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_english_only_model_refuses_chinese():
    proc = _run("--model", "tiny.en", "--language", "zh", str(LIBRIVOX[0]))
    assert proc.returncode == 2 and "English-only" in proc.stderr


def test_plain_output():
    proc = _run(str(LIBRIVOX[0]))
    assert proc.returncode == 0
    assert proc.stdout.startswith(str(LIBRIVOX[0]) + ": ") and "dashwood" in proc.stdout.lower()
