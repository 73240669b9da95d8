"""Operating the command line: every flag also an environment variable, and the log format.

A container is configured by its environment (compose files, orchestrators): each option of a
command can be given as STREAMSERVER_<OPTION>, e.g. `--redis-url` as STREAMSERVER_REDIS_URL and
`--max-queued 2000 200 8` as STREAMSERVER_MAX_QUEUED="2000 200 8". A flag on the command line
wins over the environment. Logs are text or JSON lines, with time and level, and never carry a
token: a `token=` in any message (a URL's query) is redacted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from streamserver.logs import fields_of, redact  # room_id, student_id, ... as JSON fields

PREFIX = "STREAMSERVER_"
# Variables the code reads for itself (secrets, caches, tuning), not flags: name -> (read by, what);
# docs/configuration.md lists them (streamserver/cli_docs.py).
OWN = {
    "STREAMSERVER_ADMIN_TOKEN": ("`serve`, `gateway`, `loadsim`", "the room API's admin token (`Authorization: Bearer`), "
                                 "also for `/metrics` on the main port; without it room creation is refused"),
    "STREAMSERVER_SECRET": ("`serve`, `gateway`", "signs room links; the same on every gateway of one deployment; required "
                            "with Redis (else random per process, with a warning)"),
    "STREAMSERVER_TURN_SECRET": ("`serve`, `gateway`", "the secret shared with coturn (`--use-auth-secret "
                                 "--static-auth-secret`) that `--turn-url`'s short-lived credentials are minted from"),
    "STREAMSERVER_TURN_SECRET_FILE": ("`serve`, `gateway`", "a file holding `STREAMSERVER_TURN_SECRET` (a mounted "
                                      "secret), instead of the variable"),
    "STREAMSERVER_CACHE": ("every command (`engines/cache.py`)", "where weights are assembled and ONNX graphs built "
                           "(default `~/.cache/streamserver`); anything in it can be deleted, it is rebuilt"),
    "STREAMSERVER_MODEL_DIRS": ("every command taking `--model` (`engines/weights.py`)", "folders (`:`-separated) where "
                                "`--model NAME` finds CTranslate2 Whisper model folders by name; `streamserver models` "
                                "lists them"),
    "STREAMSERVER_ORT_SPIN": ("the ONNX Runtime engine", "`0`: its threads do not spin while idle; `worker` sets `0` "
                              "unless given, `serve` spins (`1`)"),
    "STREAMSERVER_TORCH_COMPILE": ("the GPU engine", "`0`: no `torch.compile` of the decoder step (faster start, slower "
                                   "steps)"),
    "STREAMSERVER_GATEWAY_INDEX": ("`gateway`", "set by `gateway --processes` for each gateway it starts (never by "
                                   "hand): its place among them; it shares their port, and its `--metrics-port` is "
                                   "that port plus its place"),
    "STREAMSERVER_INTENT_DEVICE": ("the intent labels beside a `torch-cuda` engine", "`cpu`: on ONNX Runtime on the CPU "
                                   "instead of the engine's GPU (`auto`)"),
}
TRUE = ("1", "true", "yes", "on")  # a switch's variable: these are true, anything else false


def env_name(action: argparse.Action) -> str:
    return PREFIX + action.dest.upper()


def defaults_from_env(parser: argparse.ArgumentParser, environ: dict[str, str] | None = None,
                      argv: list[str] | None = None) -> None:
    """Set each option's default from its environment variable, converted as the flag would be;
    a bad value is a usage error naming the variable. Only the options of the command being run
    (the first word of argv that is not an option, and its own subcommand): a variable meant for
    one command (STREAMSERVER_BACKEND=auto for `worker`) must not break another's choices."""
    environ = dict(os.environ if environ is None else environ)
    words = [a for a in (argv or []) if not a.startswith("-")]
    for action in parser._actions:  # argparse keeps no public list of them
        if isinstance(action, argparse._SubParsersAction):
            # the first word naming a command (an option's value may come before it)
            at = next((i for i, word in enumerate(words) if word in action.choices), None)
            if at is not None:
                defaults_from_env(action.choices[words[at]], environ, words[at + 1 :])
            continue
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        name = env_name(action)
        if name not in environ:
            continue
        action.default = _convert(parser, action, name, environ[name])
        action.required = False
        if action.help and "env:" not in action.help:
            action.help += f" (env: {name})"


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, name: str, text: str) -> object:
    # A switch's variable names its value, as any option's does: STREAMSERVER_KEEP_AUDIO=0 is --no-keep-audio.
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return text.strip().lower() in TRUE
    convert = action.type or str
    words = text.split() if action.nargs not in (None, "?") or isinstance(action, argparse._AppendAction) else [text]
    try:
        values = [convert(word) for word in words]  # type: ignore[operator]
    except (ValueError, TypeError, argparse.ArgumentTypeError) as error:
        parser.error(f"{name}={text!r}: {error}")
    if action.choices is not None and any(v not in action.choices for v in values):
        parser.error(f"{name}={text!r}: choose from {', '.join(map(str, action.choices))}")
    if isinstance(action, argparse._AppendAction) or action.nargs not in (None, "?"):
        return values
    return values[0]


class Redacting(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "token=" in message:  # formatted already: with no args, getMessage leaves "%" alone
            record.msg, record.args = redact(message), ()
        return True


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(), "logger": record.name, **fields_of(record), "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is now (a test harness swaps it), not the one at set-up."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass


def configure_logging(level: str, fmt: str) -> None:
    handler = _Stderr()
    handler.addFilter(Redacting())
    if fmt == "json":
        handler.setFormatter(JsonLines())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
