"""A split packaged model (base: two wheels) is concatenated into the cache once. Workers that
start together on a fresh machine must not write one file at the same time: each either
assembles the copy or waits for it, and every one loads a whole, verified model.bin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engines.weights import MODELS

WORKERS = 4
LOAD = """
import json, sys
from engines.weights import ct2_model_dir, read_ct2
folder = ct2_model_dir("base")
tensors = read_ct2(folder / "model.bin")
print(json.dumps({"folder": str(folder), "tensors": len(tensors)}))
"""


def test_workers_starting_together_share_one_assembled_copy(tmp_path: Path) -> None:
    env = {**os.environ, "STREAMSERVER_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[1]) for _ in range(WORKERS)]
    outcomes = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outcomes):
        assert p.returncode == 0, err[-2000:]
    answers = [json.loads(out.strip().splitlines()[-1]) for out, _ in outcomes]
    folders = {a["folder"] for a in answers}
    assert len(folders) == 1, folders
    assert {a["tensors"] for a in answers} == {answers[0]["tensors"]} and answers[0]["tensors"] > 100
    folder = Path(folders.pop())
    assert (folder / "model.bin").stat().st_size == MODELS["base"].size
    assert (folder / "verified").read_text() == MODELS["base"].sha256
    assert not list(folder.glob("*.partial")), list(folder.iterdir())
