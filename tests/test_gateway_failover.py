"""Issue 17, gateway mode: a gateway SIGKILLed with 20 simulated students on it. The students
keep their audio as the student page does; they reconnect through the second gateway and send
again what was not acknowledged. Counted by the load simulator against what they said: 0 lost,
0 duplicated (a copy under a new utterance id counts as a duplicate: measure.py's copies)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("students", [20])
def test_students_of_a_killed_gateway_lose_nothing_through_another(tmp_path, students):
    out = tmp_path / "failover"
    env = {**os.environ, "STREAMSERVER_ADMIN_TOKEN": "failover-test"}
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.scaleout", "--students", str(students), "--duration", "40", "--workers", "1",
         "--threads", "2", "--gateways", "2", "--speak-ratio", "0.3", "--kill-gateway-at", "15", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    print({k: report[k] for k in ("utterances_sent", "transcripts_received", "lost", "duplicates", "copies", "recovered",
                                  "reconnects", "latency_s")})
    assert report["scenario"]["gateway_killed"]["gateway"] == "gateway-0"
    assert report["reconnects"] >= students // 2 - 2  # about half sat on the killed gateway (rooms alternate)
    assert report["utterances_sent"] >= 10
    assert report["recovered"] >= 1  # some spoke as the gateway died: their speech came again, through the other
    assert report["lost"] == 0 and report["duplicates"] == 0 and report["copies"] == 0
    assert report["transcripts_received"] == report["utterances_sent"]
