"""`streamserver gateway --processes N|auto`: one command, every core. An event loop is one core,
so a host carries as many gateways as it has cores; here they are the children of one command,
each a whole gateway on the same port (SO_REUSEPORT: the kernel deals new connections over them)
and on the same bus, where a room's seats, jobs and events are shared whichever child took a
student. This process starts them, hands a stop signal on to them, and starts again, after a
jittered pause, a child that died: its students reconnect to the others meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import subprocess
import sys
import time
from types import FrameType

from streamserver.config import machine_cores

log = logging.getLogger(__name__)

INDEX_ENV = "STREAMSERVER_GATEWAY_INDEX"  # which child this is (set for the children only)
PARENT_ENV = "STREAMSERVER_GATEWAY_PARENT"  # the pid of the command that started it
RESTART_FIRST_S = 1.0  # a child that died is started again after about this; doubling while it keeps dying
RESTART_MAX_S = 30.0
STEADY_S = 60.0  # a child up this long is well again: its next death waits RESTART_FIRST_S
STOP_WAIT_S = 30.0  # children get this long to close their streams before they are killed


def processes_arg(text: str) -> int:
    """--processes: a count, or auto (one per core)."""
    if text == "auto":
        return machine_cores()
    count = int(text)
    if count < 1:
        raise ValueError("at least 1")
    return count


def child_index() -> int | None:
    """This gateway's place among its siblings, when a --processes parent started it."""
    value = os.environ.get(INDEX_ENV)
    return int(value) if value is not None else None


def child_argv(argv: list[str]) -> list[str]:
    """The parent's command line for a child: the same, as one process."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--processes":
            skip = True
        elif not arg.startswith("--processes="):
            out.append(arg)
    return [*out, "--processes", "1"]


class Children:
    def __init__(self, argv: list[str], count: int) -> None:
        self.argv = [sys.executable, "-m", "streamserver", *child_argv(argv)]
        self.count = count
        self.procs: dict[int, subprocess.Popen] = {}
        self.started: dict[int, float] = {}
        self.failures: dict[int, int] = {}
        self.stopping = False

    def start(self, index: int) -> None:
        env = {**os.environ, INDEX_ENV: str(index), PARENT_ENV: str(os.getpid()), "STREAMSERVER_PROCESSES": "1"}
        # A session of its own: a terminal's Ctrl-C reaches this process only, which hands it on
        # once (a second signal would cut a child's graceful close short).
        self.procs[index] = subprocess.Popen(self.argv, env=env, start_new_session=True)
        self.started[index] = time.monotonic()

    def stop(self, signum: int, _frame: FrameType | None = None) -> None:
        self.stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    def run(self) -> int:
        for index in range(self.count):
            self.start(index)
        log.info("%d gateway processes on one port", self.count)
        due: dict[int, float] = {}  # child -> when it starts again
        while not self.stopping:
            time.sleep(0.2)
            now = time.monotonic()
            for index, proc in list(self.procs.items()):
                if index in due or proc.poll() is None:
                    continue
                well = now - self.started[index] >= STEADY_S
                self.failures[index] = 1 if well else self.failures.get(index, 0) + 1
                wait = min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** (self.failures[index] - 1)) * random.uniform(0.5, 1.5)
                log.warning("gateway process %d exited with status %s; starting it again in %.1f s",
                            index, proc.returncode, wait)
                due[index] = now + wait
            for index, at in list(due.items()):
                if now >= at and not self.stopping:
                    del due[index]
                    self.start(index)
        deadline = time.monotonic() + STOP_WAIT_S
        status = 0
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            status = status or (proc.returncode if proc.returncode and proc.returncode > 0 else 0)
        return status


async def orphaned() -> None:
    """In a child: stop when the command that started it is gone (killed, so that it could not hand
    its stop on), rather than serve on a port nobody manages. The command's pid comes from the
    command itself: it may be gone before this child has started to look."""
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.warning("the gateway command that started this process is gone; stopping")
    os.kill(os.getpid(), signal.SIGTERM)


def run_children(argv: list[str], count: int) -> int:
    """Run `count` gateways from this command line until a stop signal; their exit status."""
    children = Children(argv, count)
    signal.signal(signal.SIGTERM, children.stop)
    signal.signal(signal.SIGINT, children.stop)
    return children.run()
