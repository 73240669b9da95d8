"""A regular install works on its own: `pip install .` (not editable) into a fresh venv, then
`streamserver serve --demo-room` started from another directory serves the pages and its static
files and transcribes a student, all from the installed package (its package data included).

The install copies the source tree first (tracked and untracked, less what git ignores): pip
builds in the source folder, and a build/ left in the repository would carry deleted modules
into later wheels. pip uses the machine's configured index and cache; the server uses the
engine cache of the other tests, so the ONNX graphs are not rebuilt. About 30 s on 2 cores,
of which 26 s are the copy, the venv and pip; the server starts in 2 s and transcribes in 1 s.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterator

import aiohttp
import pytest

from benchmarks.scoring import normalize_en, wer
from engines.cache import cache_dir
from streamserver.loadsim.clients import Dashboard, link_param
from tests.server_process import ServerProcess
from tests.test_ws_ingest import ingest_url, pcm16, send_frames, wait_for

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("streamserver", "engines")


def _run(args: list[str], cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        pytest.fail(f"{' '.join(args)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return done.stdout


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the working tree: what git tracks or would track, as it is on disk."""
    if shutil.which("git") is None:
        pytest.fail("git is needed to list the source tree to install")
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT).split("\0")
    copy = tmp_path_factory.mktemp("source")
    for name in filter(lambda n: n and (ROOT / n).is_file(), listed):  # an unstaged deletion stays listed
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    return copy


@pytest.fixture(scope="module")
def venv(source, tmp_path_factory) -> Iterator[Path]:
    """A fresh venv (no system site-packages) with `pip install -c constraints.txt <source>`, as
    the image installs it (the pinned versions must resolve together); its bin folder."""
    python = shutil.which("python3.11") or sys.executable
    folder = tmp_path_factory.mktemp("venv")
    _run([python, "-m", "venv", str(folder)], folder)
    _run([str(folder / "bin" / "pip"), "install", "--quiet", "-c", str(source / "constraints.txt"), str(source)], folder)
    yield folder / "bin"
    shutil.rmtree(folder, ignore_errors=True)  # 0.7 GB; pytest keeps its last temporary folders


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("elsewhere")  # the server's working directory: not the repository


@pytest.fixture(scope="module")
def server(venv, elsewhere):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing may lead back to the repo
    env["STREAMSERVER_CACHE"] = str(cache_dir())
    with ServerProcess("--demo-room", "Installed class", program=[str(venv / "streamserver")], cwd=elsewhere, env=env) as s:
        yield s


def demo_links(server: ServerProcess) -> dict[str, str]:
    """The teacher and student URLs that `--demo-room` printed."""
    links = dict(re.findall(r"(teacher|student): (http\S+)", server.log.read_text()))
    assert set(links) == {"teacher", "student"}, server.log.read_text()[-2000:]
    return links


def test_the_install_is_the_package_with_all_its_files(source, venv, elsewhere):
    """Imported from the venv, not the repository, with every file of the source packages."""
    code = "import streamserver, engines; print(streamserver.__file__); print(engines.__file__)"
    found = [Path(line).parent for line in _run([str(venv / "python"), "-c", code], elsewhere).split()]
    assert all(venv.parent in p.parents for p in found), found
    site = found[0].parent
    files = [p.relative_to(source) for pkg in PACKAGES for p in (source / pkg).rglob("*") if p.is_file()]
    missing = [str(f) for f in files if not (site / f).is_file()]
    assert not missing, f"not installed (package data missing from pyproject.toml?): {missing}"


def test_pages_and_static_files(server):
    for link in demo_links(server).values():
        with urllib.request.urlopen(link, timeout=10) as r:
            assert r.status == 200 and r.headers.get_content_type() == "text/html"
            assert b"<html" in r.read().lower()
    with urllib.request.urlopen(server.url + "/static/student.js", timeout=10) as r:
        assert r.status == 200 and r.read() == (ROOT / "streamserver" / "web_demo" / "student.js").read_bytes()


def test_a_student_is_transcribed_on_the_teachers_feed(server, librivox):
    _, audio, reference = librivox[0]  # "and mister john dashwood had then leisure to consider ..."
    links = demo_links(server)
    room = {"room_id": link_param(links["teacher"], "room"),
            "teacher_url": links["teacher"], "student_url": links["student"]}

    async def scenario() -> dict:
        async with aiohttp.ClientSession() as s:
            dashboard = await Dashboard().open(s, server.url, room)
            async with s.ws_connect(ingest_url(server, room, "Ina")) as ws:
                assert (await ws.receive_json(timeout=10))["type"] == "ready"
                await send_frames(ws, pcm16(audio))
                [transcript] = await wait_for(dashboard, "Ina")
            await dashboard.close()
            return transcript

    transcript = asyncio.run(scenario())
    words = normalize_en(transcript["text"]).split()
    assert {"dashwood", "leisure", "consider"} <= set(words), transcript["text"]
    assert wer([reference], [transcript["text"]]) <= 0.2, transcript["text"]
    assert set(transcript["intent"]) == {"label", "score"}  # the packaged intent model ran
