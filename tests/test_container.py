"""The images of docker/ (issue 14), built and run for real: the CPU image from this tree
(docker/build-image.sh: reused while its inputs are unchanged, built on a machine that never
built them), `serve` in a container transcribing a WebSocket student, the same over HTTPS with
--tls-self-signed (the CA it wrote verifies it; a headless Chromium student joins), the compose
file valid, and the compose stack (Redis, a gateway, two workers) running a class.

Docker when its daemon answers, else Debian's podman, which `make test` installs as root
(docker/podman-host.sh; ../shared/notes/containers.md for why each setting): these tests skip
only where neither can be had. The containers use the host's network, as the gateway does in
docker/compose.yaml.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import aiohttp
import pytest
import yaml

from benchmarks.scoring import wer
from streamserver.loadsim.clients import Dashboard, create_room
from tests.server_process import ADMIN_TOKEN, ServerProcess, free_port
from tests.system_packages import require_system
from tests.test_browser import CHROMIUM, NEEDS_CHROMIUM, _chromium_flags
from tests.test_ws_ingest import ingest_url, pcm16, send_frames, wait_for

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
IMAGE_UID = 10001  # the image's streamserver user (docker/Dockerfile)


def _run(args: list[str], timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and done.returncode:
        pytest.fail(f"{' '.join(args)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return done


def _docker_runs() -> bool:
    return shutil.which("docker") is not None and subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def engine() -> str:
    """docker or podman; podman installed and set up here when it is missing and may be."""
    if _docker_runs():
        return "docker"
    if shutil.which("podman") is None or not _run(["podman", "image", "exists", "debian:bookworm-slim"], check=False).returncode == 0:
        done = _run(["sh", str(DOCKER / "podman-host.sh")], timeout=900, check=False)
        if shutil.which("podman") is None:
            require_system("podman (or a docker daemon)", f"podman cannot be installed here: {done.stderr.strip()[-500:]}")
        if done.returncode:
            pytest.fail(f"docker/podman-host.sh failed:\n{done.stderr[-4000:]}")
    return "podman"


@pytest.fixture(scope="session")
def image(engine) -> str:
    """The CPU image of this tree (docker/build-image.sh prints its name:hash)."""
    env = dict(os.environ, CONTAINER_ENGINE=engine)
    done = _run([str(DOCKER / "build-image.sh")], timeout=1800, cwd=ROOT, env=env)
    return done.stdout.strip().splitlines()[-1]


class Container(ServerProcess):
    """`ENGINE run IMAGE serve ...` on the host's network, in the foreground like a server process
    (stopping it stops the container); the admin token and secret passed through the environment."""

    def __init__(self, engine: str, image: str, *extra: str, volumes: dict[Path, str] | None = None) -> None:
        self.engine = engine
        self.name = f"streamserver-test-{os.getpid()}-{time.monotonic_ns()}"
        mounts = [a for host, inside in (volumes or {}).items() for a in ("--volume", f"{host}:{inside}")]
        self.started = time.monotonic()
        program = [engine, "run", "--rm", "--name", self.name, "--network", "host",
                   "--env", "STREAMSERVER_ADMIN_TOKEN", "--env", "STREAMSERVER_SECRET", *mounts, image]
        try:
            super().__init__("--host", "127.0.0.1", *extra, program=program)
        except BaseException:
            subprocess.run([engine, "rm", "--force", self.name], capture_output=True)
            raise
        self.ready_s = time.monotonic() - self.started

    def exec(self, *command: str) -> subprocess.CompletedProcess:
        return _run([self.engine, "exec", self.name, *command], check=False)

    def stop(self) -> None:
        super().stop()
        subprocess.run([self.engine, "rm", "--force", self.name], capture_output=True)


def _writable_by_image(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(path, IMAGE_UID, IMAGE_UID)
    else:
        path.chmod(0o777)
    return path


async def _student_is_transcribed(server, audio, reference: str, name: str, ssl_context: ssl.SSLContext | None = None) -> dict:
    """A room on `server`, its teacher feed, a WebSocket student saying `audio`; its transcript."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_context) if ssl_context else None) as s:
        room = await create_room(s, server.url, ADMIN_TOKEN, f"{name}'s class")
        dashboard = await Dashboard().open(s, server.url, room)
        async with s.ws_connect(ingest_url(server, room, name)) as ws:
            assert (await ws.receive_json(timeout=10))["type"] == "ready"
            await send_frames(ws, pcm16(audio))
            [transcript] = await wait_for(dashboard, name, timeout=90)
        await dashboard.close()
    assert wer([reference], [transcript["text"]]) <= 0.2, transcript["text"]
    return transcript


def test_container_serve_transcribes_a_websocket_student(engine, image, librivox):
    _, audio, reference = librivox[0]
    with Container(engine, image) as server:
        log = server.log.read_text()
        # the graphs are in the image: nothing is built at start, and the server is up in seconds
        assert "building graph" not in log, log
        assert server.ready_s < 30, f"ready after {server.ready_s:.1f} s"
        assert server.exec("id", "-u").stdout.strip() == str(IMAGE_UID)
        installed = server.exec("python3", "-c", "import streamserver; print(streamserver.__file__)").stdout
        assert installed.startswith("/opt/streamserver/lib/python3.11/site-packages/"), installed
        if engine == "podman":  # the image's HEALTHCHECK, run as the runtime runs it
            assert _run([engine, "healthcheck", "run", server.name], check=False).returncode == 0
        asyncio.run(_student_is_transcribed(server, audio, reference, "Cora"))


@pytest.fixture(scope="module")
def tls_container(engine, image, tmp_path_factory) -> Iterator[tuple[Container, Path]]:
    """`serve --tls-self-signed /data/tls` with /data/tls mounted from here."""
    tls_dir = _writable_by_image(tmp_path_factory.mktemp("container") / "tls")
    with Container(engine, image, "--tls-self-signed", "/data/tls", volumes={tls_dir: "/data/tls"}) as server:
        yield server, tls_dir


def test_container_https_self_signed(tls_container, engine, librivox):
    server, tls_dir = tls_container
    assert server.url.startswith("https://")
    trusted = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))  # the CA it wrote, mounted out
    with urllib.request.urlopen(server.url + "/healthz", timeout=5, context=trusted) as response:
        assert response.status == 200
    with urllib.request.urlopen(server.url + "/ca.crt", timeout=5, context=trusted) as response:
        assert response.read() == (tls_dir / "ca.crt").read_bytes()
    if engine == "podman":  # the HEALTHCHECK follows the flags: https on --port
        assert _run([engine, "healthcheck", "run", server.name], check=False).returncode == 0
    _, audio, reference = librivox[3]
    transcript = asyncio.run(_student_is_transcribed(server, audio, reference, "Tess", ssl_context=trusted))
    assert transcript["student_name"] == "Tess"


@NEEDS_CHROMIUM
def test_container_https_browser_student(tls_container, tmp_path, librivox):
    """A headless Chromium student joins the container's https room page over WebRTC (certificate
    errors ignored) and is transcribed on the teacher's dashboard page."""
    from playwright.sync_api import sync_playwright

    from streamserver.loadsim.clients import speech_file

    server, tls_dir = tls_container
    _, audio, reference = librivox[0]
    mic = speech_file(tmp_path / "speech.wav", audio)
    trusted = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))

    async def make_room() -> dict:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trusted)) as s:
            return await create_room(s, server.url, ADMIN_TOKEN, "Year 8 over https")

    room = asyncio.run(make_room())
    assert room["student_url"].startswith("https://") and room["teacher_url"].startswith("https://")
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
            args=[*_chromium_flags(mic), "--ignore-certificate-errors"],
        )
        teacher, student = browser.new_page(), browser.new_page()
        teacher.goto(room["teacher_url"])
        teacher.locator("#feed-status", has_text="live").wait_for(timeout=15000)
        student.goto(room["student_url"] + "&name=Hana")
        student.click("#join")
        student.locator("#status", has_text="connected").wait_for(timeout=20000)
        texts: list[str] = []
        deadline = time.time() + 60
        while time.time() < deadline and not (texts and wer([reference], [" ".join(texts)]) <= 0.2):
            texts = teacher.eval_on_selector_all('.transcript:not(.partial)[data-student-name="Hana"] .text', "els => els.map(e => e.textContent)")
            time.sleep(0.5)
        browser.close()
    assert texts, "no transcript reached the dashboard"
    assert wer([reference], [" ".join(texts)]) <= 0.2, texts


# --- docker/compose.yaml -------------------------------------------------------------------------

COMPOSE = DOCKER / "compose.yaml"


def _compose_tools() -> list[list[str]]:
    """Every compose implementation here that reads a file without a daemon."""
    tools = []
    if _docker_runs() and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        tools.append(["docker", "compose"])
    venv = Path(sys.executable).parent  # podman-compose comes with the dev extra
    for name in ("docker-compose", "podman-compose"):  # v1 validates against the compose schema
        if path := ((venv / name).exists() and str(venv / name)) or shutil.which(name):
            tools.append([path])
    return tools


def test_compose_file_is_valid():
    tools = _compose_tools()
    assert tools, "no compose implementation (podman-compose is in the dev extra; make test installs it)"
    env_file = DOCKER / ".env.example"
    for tool in tools:
        for profile in ([], ["--profile", "gpu"], ["--profile", "turn"]):
            done = _run([*tool, "--env-file", str(env_file), "-f", str(COMPOSE), *profile, "config"], cwd=ROOT)
            assert "worker-1" in done.stdout and "redis-server" in done.stdout, (tool, done.stdout[-2000:])

    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"redis", "gateway", "worker-1", "worker-2", "worker-gpu", "turn"} <= set(services)
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "--requirepass ${REDIS_PASSWORD" in redis_cmd
    assert services["worker-gpu"]["profiles"] == ["gpu"] and "profiles" not in services["worker-1"]
    assert services["worker-gpu"]["build"]["dockerfile"] == "docker/Dockerfile.gpu"
    # every setting the file needs is in the example env file
    example = {line.split("=", 1)[0] for line in env_file.read_text().splitlines() if "=" in line and not line.startswith("#")}
    needed = set(re.findall(r"\$\{([A-Z_]+)", COMPOSE.read_text()))
    assert needed <= example, needed - example


def test_compose_services_settings_parse():
    """Each streamserver service's command line, with its image's and its compose environment
    (.env.example's values), is one the CLI accepts: every STREAMSERVER_ variable is read for
    every subcommand, so one that another subcommand refuses would stop the container at start."""
    tools = [t for t in _compose_tools() if t[0].endswith("podman-compose") or t[0].endswith("docker-compose")]
    assert tools, "no compose implementation (podman-compose is in the dev extra)"
    resolved = _run([*tools[0], "--env-file", str(DOCKER / ".env.example"), "-f", str(COMPOSE), "--profile", "gpu", "config"], cwd=ROOT)
    services = yaml.safe_load(resolved.stdout)["services"]
    image_env = {}
    for name in ("Dockerfile", "Dockerfile.gpu"):  # the ENV lines of each image, STREAMSERVER_ ones
        text = (DOCKER / name).read_text().replace("\\\n", " ")
        image_env[name] = dict(re.findall(r"(STREAMSERVER_[A-Z_]+)=(\S+)", " ".join(l for l in text.splitlines() if l.startswith("ENV"))))
    checked = 0
    for name, service in services.items():
        if "streamserver" not in str(service.get("image", "")):
            continue
        environment = service.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(e.split("=", 1) for e in environment)
        dockerfile = Path(service["build"]["dockerfile"]).name
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSERVER_")}
        env |= image_env[dockerfile] | {k: str(v) for k, v in environment.items()}
        done = _run([sys.executable, "-m", "streamserver", *service["command"], "--help"], env=env, check=False)
        assert done.returncode == 0, (name, done.stderr[-2000:])
        checked += 1
    assert checked >= 4, services.keys()  # gateway, two CPU workers, the GPU worker


@pytest.fixture(scope="module")
def redis_image(engine) -> str:
    """Redis for the stack: the official image where it can be pulled, else Debian's package on
    the same base (docker/redis-debian.Dockerfile), tagged by the Dockerfile's hash."""
    dockerfile = DOCKER / "redis-debian.Dockerfile"
    name = f"streamserver-redis:{hashlib.sha256(dockerfile.read_bytes()).hexdigest()[:12]}"
    if _run([engine, "image", "inspect", name], check=False).returncode:
        extra = ["--network", "host"] if engine == "podman" else []
        _run([engine, "build", *extra, "-f", str(dockerfile), "-t", name, str(DOCKER)], timeout=600)
    return name


def test_compose_stack_runs_a_class(engine, image, redis_image, tmp_path, librivox):
    """`compose up` of docker/compose.yaml (podman-compose here): a student through the gateway
    is transcribed by the stack's workers and reaches the teacher's feed; then `down -v`."""
    tools = [t for t in _compose_tools() if t[0] != "docker-compose"]  # v1 cannot drive podman
    if engine == "podman":
        tools = [t for t in tools if t[0].endswith("podman-compose")]
    assert tools, "no compose implementation to run the stack (podman-compose is in the dev extra)"
    ports = {"REDIS_PORT": free_port(), "GATEWAY_PORT": free_port(), "GATEWAY_METRICS_PORT": free_port()}
    password = "stackpw" + hashlib.sha256(str(time.time()).encode()).hexdigest()[:16]
    settings = {
        "STREAMSERVER_ADMIN_TOKEN": ADMIN_TOKEN, "STREAMSERVER_SECRET": "compose-test-secret", "REDIS_PASSWORD": password,
        "GATEWAY_HOST": "127.0.0.1", "GATEWAY_REDIS_URL": f"redis://:{password}@127.0.0.1:{ports['REDIS_PORT']}",
        "WORKER_THREADS": "1", "STREAMSERVER_IMAGE": image, "REDIS_IMAGE": redis_image, **{k: str(v) for k, v in ports.items()},
    }
    lines = [line for line in (DOCKER / ".env.example").read_text().splitlines() if line.split("=", 1)[0] not in settings]
    env_file = tmp_path / "stack.env"
    env_file.write_text("\n".join([*lines, *(f"{k}={v}" for k, v in settings.items())]) + "\n")
    compose = [*tools[0], "--env-file", str(env_file), "-f", str(COMPOSE), "-p", f"sstest{ports['GATEWAY_PORT']}"]
    url = f"https://127.0.0.1:{ports['GATEWAY_PORT']}"
    unverified = ssl._create_unverified_context()
    try:
        _run([*compose, "up", "-d"], timeout=300, cwd=ROOT)
        deadline = time.time() + 120
        while True:  # ready: the gateway reaches Redis and sees a live worker
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=2, context=unverified) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                logs = _run([*compose, "logs"], check=False, cwd=ROOT)
                pytest.fail(f"the stack's gateway is not ready:\n{(logs.stdout + logs.stderr)[-6000:]}")
            time.sleep(1)
        _, audio, reference = librivox[0]
        server = SimpleNamespace(url=url)
        transcript = asyncio.run(_student_is_transcribed(server, audio, reference, "Stan", ssl_context=unverified))
        assert transcript["room_id"]
        project = f"sstest{ports['GATEWAY_PORT']}"
        running = [n for n in _run([engine, "ps", "--format", "{{.Names}}"]).stdout.split() if project in n]
        workers = [n for n in running if "worker" in n]
        assert len(workers) == 2, running
        if engine == "podman":  # the HEALTHCHECK of services configured by STREAMSERVER_* variables alone
            for name in [*workers, *(n for n in running if "gateway" in n)]:
                done = _run([engine, "healthcheck", "run", name], check=False)
                assert done.returncode == 0, (name, done.stdout + done.stderr)
    finally:
        _run([*compose, "down", "-v"], timeout=180, check=False, cwd=ROOT)
