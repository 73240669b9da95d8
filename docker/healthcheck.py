"""The image's HEALTHCHECK: GET /healthz of the streamserver running in this container.

The flags are the only settings that say where it listens, and they differ per service (compose
`command:`), so this reads them off the running process: `serve` and `gateway` answer on --host
and --port (https with --tls-cert or --tls-self-signed), a worker on --metrics-host and
--metrics-port. A worker without --metrics-port has no HTTP side: healthy while its process runs.
Exit 0 healthy, 1 not (the reason on stdout, which `docker inspect` / `podman healthcheck run`
show). Standard library only; it runs with the image's venv Python.
"""

from __future__ import annotations

import ssl
import sys
import urllib.request
from pathlib import Path

COMMANDS = ("serve", "gateway", "worker")


def running_command() -> tuple[str, list[str]] | None:
    """(subcommand, its arguments) of the streamserver process in this container."""
    for proc in sorted((p for p in Path("/proc").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        try:
            argv = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        for i, arg in enumerate(argv[:-1]):
            if Path(arg).name == "streamserver" and argv[i + 1] in COMMANDS:
                return argv[i + 1], argv[i + 2 :]
    return None


def option(args: list[str], name: str, default: str | None = None) -> str | None:
    """The last value of --name (as `--name V` or `--name=V`), as argparse would take it."""
    value = default
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def healthz_url(command: str, args: list[str]) -> str | None:
    if command == "worker":
        port = option(args, "--metrics-port")
        if port is None:
            return None
        host, scheme = option(args, "--metrics-host", "127.0.0.1"), "http"
    else:
        port = option(args, "--port", "8080")
        host = option(args, "--host", "127.0.0.1")
        tls = any(a.split("=", 1)[0] in ("--tls-cert", "--tls-self-signed") for a in args)
        scheme = "https" if tls else "http"
    if host in ("0.0.0.0", "::", ""):  # every interface: loopback is one of them
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}/healthz"


def main() -> int:
    found = running_command()
    if found is None:
        print("no streamserver serve/gateway/worker process")
        return 1
    url = healthz_url(*found)
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
