"""Each default is written once (issue 28): in the settings dataclass or the module that owns it,
and read from there by the command line and by every function that takes it as a parameter.

Two checks. The command line: every option of every command either reads its default from its
one source (SOURCES: the argparse default is that value, and the `default=` written in the code is
no literal) or owns it (CLI_OWN, a literal written at one place). And the code (streamserver/,
engines/): no second literal of a sourced default, under any of the names it goes by (its
attribute, the option's dest, ALIASES), anywhere but at its source. Where a source passes the very object on, the
argparse default must be it (`is`): a second literal of the same value is another object, except
for the short strings Python shares, which the code scan catches.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
from dataclasses import astuple
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest

from engines import backends, graphs, weights
from engines.tensorrt import builder
from engines.tensorrt.profiles import ProfileSettings
from streamserver import cli, config
from streamserver.audio import pacing
from streamserver.audio.segmenter import SegmenterConfig
from streamserver.bus import keys
from streamserver.config import Bounds, Settings
from streamserver.loadsim.config import LoadConfig

ROOT = Path(__file__).resolve().parents[1]
SERVER = ("serve", "gateway")

# (command, dest) -> (owner, attribute): where the option's default is written. An owner that
# reads another's (Settings.model is engines.weights.DEFAULT_MODEL) is named by the one the
# command line reads; the code scan follows both.
SOURCES: dict[tuple[str, str], tuple[Any, str]] = {
    **{(c, "model"): (weights, "DEFAULT_MODEL") for c in ("transcribe", "engine build")},
    **{(c, "model"): (Settings, "model") for c in ("serve", "worker")},
    ("transcribe", "backend"): (backends, "DEFAULT_BACKEND"),
    **{(c, "backend"): (Settings, "backend") for c in ("serve", "worker")},
    ("transcribe", "precision"): (graphs, "DEFAULT_PRECISION"),
    ("engine build", "precision"): (builder, "PRECISION"),
    ("engine build", "max_batch"): (ProfileSettings, "max_batch"),
    **{(c, d): (Settings, a) for c in SERVER for d, a in (
        ("host", "host"), ("port", "port"), ("max_students", "max_students"), ("link_ttl", "token_ttl_s"),
        ("room_idle_expiry", "room_idle_ttl_s"), ("max_queue_wait", "max_queue_wait_s"),
        ("expected_speaking", "expected_speaking"), ("max_audio_rate", "max_audio_rate"),
        ("partial_interval_ms", "partial_interval_ms"), ("idle_seat", "idle_seat_s"), ("offers_per_minute", "offers_per_minute"),
        ("header_timeout", "header_timeout_s"),
        ("turn_ttl", "turn_ttl_s"))},
    **{(c, "vad_hangover_ms"): (SegmenterConfig, "hangover_ms") for c in SERVER},
    **{(c, "partials"): (Settings, "partials") for c in (*SERVER, "worker")},
    **{(c, "redis_prefix"): (Settings, "redis_prefix") for c in (*SERVER, "worker")},
    **{(c, "metrics_host"): (cli, "METRICS_HOST") for c in (*SERVER, "worker")},
    ("gateway", "fallback_after"): (Settings, "fallback_after_s"),
    **{("loadsim", d): (LoadConfig, a) for d, a in (
        ("speak_ratio", "speak_ratio"), ("transport", "transport"), ("webrtc_students", "webrtc_students"),
        ("webrtc_client", "webrtc_client"), ("rooms", "rooms"), ("language", "language"), ("frame_ms", "frame_ms"),
        ("processes", "processes"), ("seed", "seed"), ("keep_audio", "keep_audio"), ("drain", "drain_s"))},
}
# Sources the command line reads in another form: the default is computed from the source.
COMPUTED: dict[tuple[str, str], tuple[Any, str, Any]] = {
    **{(c, "max_queued"): (Bounds, "total", astuple(Bounds())) for c in SERVER},
    **{(c, "transcript_retention_days"): (keys, "TRANSCRIPT_RETENTION_S", keys.TRANSCRIPT_RETENTION_S / cli.DAY_S)
       for c in (*SERVER, "worker")},
}
# The machine's: no argparse default, the value is worked out at start (cli._threads).
AT_START = ({(c, "threads") for c in ("transcribe", "serve", "worker")} | {("gateway", "fallback_threads")}
            | {("worker", "max_batch")})  # by the engine: a GPU's or a CPU's
# Defaults that only the command line has: written once, there.
CLI_OWN = {("", "log_level"), ("", "log_format"), ("transcribe", "language"), ("engine build", "backend"),
           ("gateway", "processes")}
# Other names a sourced default goes by in the code (a parameter that takes it).
ALIASES = {(Settings, "fallback_after_s"): ("after_s",)}
# Where the code scan looks for each owner's second literals: the load simulator's defaults (a
# frame length, a language) are its own, and the server's others of the same names are not them.
LOADSIM = ROOT / "streamserver" / "loadsim"


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):  # noqa: ANN202 - a generator
    yield " ".join(words), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*words, name))


def _options() -> list[tuple[str, argparse.Action, tuple[str, int]]]:
    """(command, option, where in the code its add_argument call is) for every option with a dest."""
    sites: dict[int, tuple[str, int]] = {}
    original = argparse._ActionsContainer.add_argument

    def recording(self: argparse._ActionsContainer, *args: Any, **kwargs: Any) -> argparse.Action:
        action = original(self, *args, **kwargs)
        caller = sys._getframe(1)
        sites[id(action)] = (caller.f_code.co_filename, caller.f_lineno)
        return action

    with mock.patch.object(argparse._ActionsContainer, "add_argument", recording):
        parser = cli.build_parser()
    return [(command, action, sites[id(action)]) for command, p in _commands(parser) for action in p._actions
            if action.option_strings and action.dest not in ("help", "version")]


def _default_written(site: tuple[str, int]) -> ast.expr | None:
    """The `default=` expression of the add_argument call at that place (None: none written)."""
    path, line = site
    calls = [node for node in ast.walk(ast.parse(Path(path).read_text(encoding="utf-8")))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
             and node.lineno <= line <= (node.end_lineno or node.lineno)]
    call = min(calls, key=lambda c: (c.end_lineno or c.lineno) - c.lineno)
    return next((k.value for k in call.keywords if k.arg == "default"), None)


def _literal(node: ast.expr) -> tuple[bool, Any]:
    """(is it a literal, its value): constants, and tuples and arithmetic of them (12 * 3600)."""
    try:
        return True, ast.literal_eval(node)
    except ValueError:
        pass
    if isinstance(node, ast.BinOp) and _literal(node.left)[0] and _literal(node.right)[0]:
        return True, eval(compile(ast.Expression(node), "<default>", "eval"))  # noqa: S307 - constants only
    return False, None


OPTIONS = _options()


def test_every_option_says_where_its_default_is_written():
    implicit = (argparse._StoreTrueAction, argparse._CountAction)  # False or None unless one is written
    unplaced = sorted({f"{c or 'streamserver'} {a.option_strings[-1]}" for c, a, _ in OPTIONS
                       if (c, a.dest) not in (*SOURCES, *COMPUTED, *AT_START, *CLI_OWN)
                       and a.default is not None and not a.required and not (isinstance(a, implicit) and not a.default)})
    assert not unplaced, ("options with a default that tests/test_defaults.py does not place (read it from the "
                          f"settings or the module that owns it and add it to SOURCES, or to CLI_OWN): {unplaced}")


def _cases(placed: dict) -> list:
    return [pytest.param(c, a, site, id=f"{c} {a.option_strings[-1]}") for c, a, site in OPTIONS if (c, a.dest) in placed]


@pytest.mark.parametrize("command,action,site", _cases(SOURCES))
def test_a_sourced_default_is_read_from_its_source(command: str, action: argparse.Action, site: tuple[str, int]):
    owner, attribute = SOURCES[(command, action.dest)]
    written = _default_written(site)
    where = f"{Path(site[0]).relative_to(ROOT)}:{site[1]}"
    assert written is not None and not _literal(written)[0], (
        f"{where}: {action.option_strings[-1]} writes its default again ({ast.unparse(written) if written else 'none'}); "
        f"read it from {getattr(owner, '__name__', owner)}.{attribute}")
    assert action.default is getattr(owner, attribute), f"{where}: {action.option_strings[-1]} is not {attribute}"


@pytest.mark.parametrize("command,action,site", _cases(COMPUTED))
def test_a_computed_default_is_computed_from_its_source(command: str, action: argparse.Action, site: tuple[str, int]):
    written = _default_written(site)
    assert written is not None and not _literal(written)[0], f"{site}: {action.option_strings[-1]} writes its default again"
    assert action.default == COMPUTED[(command, action.dest)][2]


def test_thread_counts_are_worked_out_from_one_place():
    for command, action, _ in OPTIONS:
        if (command, action.dest) in AT_START:
            assert action.default is None, f"{command} {action.option_strings[-1]}"
    assert cli._threads(None) == config.default_threads() == Settings().threads
    assert cli._threads(None, cli.FALLBACK_THREADS_MAX) == config.default_threads(cli.FALLBACK_THREADS_MAX)
    assert cli._threads(3) == 3


def test_a_default_the_command_line_owns_is_written_once():
    """The same option with the same literal default at two places in the code: written twice."""
    seen: dict[tuple[str, Any], set[tuple[str, int]]] = {}
    for _, action, site in OPTIONS:
        written = _default_written(site)
        literal, value = _literal(written) if written is not None else (False, None)
        if literal:
            seen.setdefault((action.option_strings[-1], repr(value)), set()).add(site)
    twice = {key: sorted(sites) for key, sites in seen.items() if len(sites) > 1}
    assert not twice, f"defaults written more than once (a constant, or one helper that adds the option): {twice}"


# --- streamserver/: no second literal of a sourced default ------------------------------------------


def _named_values(tree: ast.AST):  # noqa: ANN202 - a generator of (name, value node)
    """Every name given a value: assignments, parameters' defaults, keyword arguments."""
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            target = node.target
            yield (target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")), node.value
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, (ast.Name, ast.Attribute)):
                    yield (target.id if isinstance(target, ast.Name) else target.attr), node.value
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            yield from ((a.arg, d) for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults))
            yield from ((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None)
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg, node.value


def _same(a: Any, b: Any) -> bool:
    """Equal, and a bool only equals a bool (True == 1 is another default)."""
    return (type(a) is bool) == (type(b) is bool) and a == b


def _source_site(owner: Any, attribute: str) -> tuple[Path, int, int]:
    """Where a default's source writes it: file, line and column of the value."""
    module = owner if isinstance(owner, ModuleType) else sys.modules[owner.__module__]
    path = Path(inspect.getsourcefile(module) or "")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = tree.body if isinstance(owner, ModuleType) else next(
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == owner.__name__).body
    for node in body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for name, value in _named_values(node):
                if name == attribute:
                    return path, value.lineno, value.col_offset
    raise AssertionError(f"no {attribute} in {module.__name__}")


# The settings' fields that only pass on another module's default: the names they go by belong to it.
PASSED_ON = {"model": (weights, "DEFAULT_MODEL"), "backend": (backends, "DEFAULT_BACKEND"),
             "max_audio_rate": (pacing, "RATE"), "vad_hangover_ms": (SegmenterConfig, "hangover_ms"),
             "transcript_retention_s": (keys, "TRANSCRIPT_RETENTION_S")}


def _sources() -> dict[tuple[Any, str], set[str]]:
    """Each default's source -> the names it goes by in the code."""
    found: dict[tuple[Any, str], set[str]] = {}
    for (_, dest), (owner, attribute, *_) in [*SOURCES.items(), *COMPUTED.items()]:
        found.setdefault((owner, attribute), set()).update({attribute, dest})
    for field, owner in PASSED_ON.items():
        found.setdefault(owner, set()).update({field, *found.pop((Settings, field), set())})
    for key, names in ALIASES.items():
        found.setdefault(key, set()).update(names)
    return found


def _scanned(loadsim: bool) -> list[Path]:
    """The server's code (engines/ included: it owns the model, backend and precision defaults), or
    the load simulator's."""
    files = sorted([*(ROOT / "streamserver").rglob("*.py"), *(ROOT / "engines").rglob("*.py")])
    return [p for p in files if (LOADSIM in p.parents) == loadsim]


SCANNED = {loadsim: [(p, ast.parse(p.read_text(encoding="utf-8"))) for p in _scanned(loadsim)] for loadsim in (False, True)}


@pytest.mark.parametrize("owner,attribute", sorted(_sources(), key=lambda k: (getattr(k[0], "__name__", ""), k[1])),
                         ids=lambda v: v if isinstance(v, str) else getattr(v, "__name__", str(v)))
def test_no_second_literal_of_a_default_in_the_code(owner: Any, attribute: str):
    names = _sources()[(owner, attribute)]
    home, line, column = _source_site(owner, attribute)
    values = [getattr(owner, attribute), *(v for o, a, v in COMPUTED.values() if (o, a) == (owner, attribute))]
    again = []
    for path, tree in SCANNED[owner is LoadConfig]:
        for name, node in _named_values(tree):
            if name not in names or (path, node.lineno, node.col_offset) == (home, line, column):
                continue
            literal, value = _literal(node)
            if literal and any(_same(value, v) for v in values):
                again.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name} = {ast.unparse(node)}")
    assert not again, (f"the default of {getattr(owner, '__name__', owner)}.{attribute} is written again; read it from "
                       "there:\n" + "\n".join(again))


def test_the_machine_is_asked_for_its_cores_in_one_place():
    """config.machine_cores() is where the CPU count is asked for (threads and processes are
    worked out of it)."""
    lines, first = inspect.getsourcelines(config.machine_cores)
    home = range(first, first + len(lines))
    elsewhere = [f"{path.relative_to(ROOT)}:{node.lineno}" for path, tree in SCANNED[False] for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.cpu_count"
                 and not (path == ROOT / "streamserver" / "config.py" and node.lineno in home)]
    assert not elsewhere, f"the CPU count is asked for outside config.machine_cores: {elsewhere}"


# --- the bounded numbers of the command line ------------------------------------------------------


@pytest.mark.parametrize("parse,good,bad", [
    (cli._share, ["0.1", "1"], ["0", "1.01", "nan", "x"]),
    (cli._positive_seconds, ["0.5", "3600"], ["0", "-1", "3601", "inf"]),
    (cli._hangover_ms, ["250", "2000"], ["249", "2001", "300.5"]),
    (cli._partial_interval_ms, ["250", "10000"], ["100", "10001"]),
    (cli._retention_days, ["0.5", "3650"], ["0.01", "3651"]),
])
def test_bounded_numbers(parse, good, bad):  # noqa: ANN001 - argparse types
    for text in good:
        assert parse(text) == float(text)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
