"""The image's HEALTHCHECK: GET /livez of the streamserver running in this container.

Liveness, not readiness: a gateway whose Redis is unreachable is alive and not ready (/readyz
503); marked unhealthy for it, an orchestrator would restart it for an outage a restart cannot
mend (streamserver/api/probes.py).

Where it listens differs per service, so this reads the settings off the running process, as
the command line does: a flag, else its STREAMSERVER_<OPTION> variable (streamserver/cli_env.py),
else the default. `serve` and `gateway` answer on --host and --port (https with --tls-cert or
--tls-self-signed), a worker on --metrics-host and --metrics-port. A worker without
--metrics-port has no HTTP side: healthy while its process runs.
Exit 0 healthy, 1 not (the reason on stdout, which `docker inspect` / `podman healthcheck run`
show). Standard library only; it runs with the image's venv Python.
"""

from __future__ import annotations

import ssl
import sys
import urllib.request
from pathlib import Path

COMMANDS = ("serve", "gateway", "worker")


def _split(data: bytes) -> list[str]:
    return [a.decode(errors="replace") for a in data.split(b"\0") if a]


def running_command() -> tuple[str, list[str], dict[str, str]] | None:
    """(subcommand, its arguments, its environment) of the streamserver process in this container."""
    for proc in sorted((p for p in Path("/proc").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        try:
            argv = _split((proc / "cmdline").read_bytes())
        except OSError:
            continue
        for i, arg in enumerate(argv[:-1]):
            if Path(arg).name == "streamserver" and argv[i + 1] in COMMANDS:
                try:
                    environ = dict(v.split("=", 1) for v in _split((proc / "environ").read_bytes()) if "=" in v)
                except OSError:
                    environ = {}
                return argv[i + 1], argv[i + 2 :], environ
    return None


def option(args: list[str], environ: dict[str, str], name: str, default: str | None = None) -> str | None:
    """--name's value as the command line takes it: the last `--name V` or `--name=V`, else
    STREAMSERVER_NAME from the environment, else the default."""
    value = environ.get("STREAMSERVER_" + name.lstrip("-").replace("-", "_").upper(), default)
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def probe_url(command: str, args: list[str], environ: dict[str, str]) -> str | None:
    if command == "worker":
        port = option(args, environ, "--metrics-port")
        if not port:
            return None
        host, scheme = option(args, environ, "--metrics-host", "127.0.0.1"), "http"
    else:
        port = option(args, environ, "--port", "8080")
        host = option(args, environ, "--host", "127.0.0.1")
        tls = any(option(args, environ, flag) for flag in ("--tls-cert", "--tls-self-signed"))
        scheme = "https" if tls else "http"
    if host in ("0.0.0.0", "::", ""):  # every interface: loopback is one of them
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}/livez"


def main() -> int:
    found = running_command()
    if found is None:
        print("no streamserver serve/gateway/worker process")
        return 1
    url = probe_url(*found)
    if url is None:
        print("worker without --metrics-port: its process runs")
        return 0
    # The certificate is for the names students use, not for loopback: this only asks whether
    # the process answers, so it does not verify it.
    context = ssl._create_unverified_context()  # noqa: S323
    try:
        with urllib.request.urlopen(url, timeout=4, context=context) as response:
            print(f"{url}: {response.status}")
            return 0 if response.status == 200 else 1
    except OSError as error:
        print(f"{url}: {error}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
