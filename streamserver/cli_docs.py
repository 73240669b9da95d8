"""docs/configuration.md, written from the command line's own parsers: every option of every
command with its environment variable and default, and the variables the code reads for itself.

    python -m streamserver.cli_docs > docs/configuration.md

The parsers are built as `streamserver` builds them, without the environment applied, so the
defaults shown are the code's. tests/test_configuration_doc.py fails when the committed file
differs from what this writes.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator

from streamserver.cli import build_parser
from streamserver.cli_env import OWN, TRUE, env_name

REGENERATE = "python -m streamserver.cli_docs > docs/configuration.md"

INTRO = f"""# Configuration

<!-- Written by `{REGENERATE}` from the command line's parsers
(streamserver/cli.py): change the code, then run that, rather than editing this file. -->

Every option of a command is also an environment variable, `STREAMSERVER_<OPTION>`
(`streamserver/cli_env.py`): a container is configured by its environment. A flag on the command
line wins over the variable; a bad value is a usage error naming the variable; an option that takes
several values, or is repeatable, takes them space-separated in its variable
(`STREAMSERVER_ICE_SERVER="stun:a:3478 turn:b:3478"`); a switch's variable is true for {", ".join(f"`{t}`" for t in TRUE)}.
Only the options of the command being run read their variables, so one meant for `worker` does not
trouble `engine build`. A default left empty means the option is off unless given, or that the
text says what happens without it. Deploying: [operations.md](operations.md); containers:
[docker/README.md](../docker/README.md).
"""


def commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """(the words of the command, its parser, its one-line help), the top level first, then each
    subcommand in the order the command line lists them."""
    yield words, parser, ""
    for action in parser._actions:  # argparse keeps no public list of them
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*words, name), sub, helps.get(name, "")
                for nested in commands(sub, (*words, name)):
                    if nested[0] != (*words, name):
                        yield nested


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options that have a variable: every flag but --help and --version."""
    return [a for a in parser._actions if a.option_strings and a.dest not in ("help", "version")
            and not isinstance(a, argparse._SubParsersAction)]


def shown_default(action: argparse.Action) -> str:
    """The default as its variable would be written; empty for none."""
    if action.required:
        return "required"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"  # a switch: not given
    if isinstance(action, argparse._StoreFalseAction):  # its variable names the value: `0` is the flag
        return "on (`0`: the flag)"
    value = action.default
    if value is None:
        return ""
    values = value if isinstance(value, (list, tuple)) else [value]
    return "`" + " ".join(format(v, "g") if isinstance(v, float) else str(v) for v in values) + "`"


# "default %(default)s" in a help text: --help has no column for the default, this file has one.
_DEFAULT_IN_HELP = re.compile(r";\s*default %\(default\)[sg]|\s*\(default %\(default\)[sg]\)")


def _what(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text as --help shows it, less the default it names."""
    if not action.help:
        return ""
    bare = argparse.Namespace(**vars(action))
    bare.help = _DEFAULT_IN_HELP.sub("", action.help)
    return parser._get_formatter()._expand_help(bare)  # type: ignore[arg-type]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = ["| flag | variable | default | what |", "| --- | --- | --- | --- |"]
    for action in options(parser):
        flag = formatter._format_action_invocation(action)
        rows.append(f"| `{_cell(flag)}` | `{env_name(action)}` | {_cell(shown_default(action))} | {_cell(_what(parser, action))} |")
    return rows


def configuration_markdown() -> str:
    lines = [INTRO.rstrip("\n")]
    for words, parser, summary in commands(build_parser()):
        if not options(parser):
            continue
        lines += ["", f"## `{' '.join(('streamserver', *words))}`", ""]
        if not words:
            summary = "Options of every command, given before the command's name."
        if summary:
            lines += [_cell(summary[0].upper() + summary[1:]) + ("" if summary.endswith(".") else "."), ""]
        lines += _table(parser)
    lines += ["", "## Variables the code reads for itself", "",
              "Not flags: secrets, caches and tuning, read where they are used.", "",
              "| variable | read by | what |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | {_cell(reader)} | {_cell(what)} |" for name, (reader, what) in OWN.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(configuration_markdown())


if __name__ == "__main__":
    main()
