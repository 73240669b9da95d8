"""docs/configuration.md is what streamserver/cli_docs.py writes from the command line's parsers,
and it names every variable: each flag's, and each one the code reads from the environment itself."""

from __future__ import annotations

import re
from pathlib import Path

from streamserver import cli_docs
from streamserver.cli import build_parser
from streamserver.cli_env import OWN, env_name

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


def test_the_committed_file_is_what_the_parsers_write():
    assert DOC.read_text(encoding="utf-8") == cli_docs.configuration_markdown(), (
        f"docs/configuration.md is not what the command line says: regenerate it with `{cli_docs.REGENERATE}`")


def test_every_flag_of_every_command_is_listed():
    listed = DOC.read_text(encoding="utf-8")
    missing = [f"{' '.join(words) or 'streamserver'} {action.option_strings[-1]}"
               for words, parser, _ in cli_docs.commands(build_parser()) for action in cli_docs.options(parser)
               if f"`{env_name(action)}`" not in listed or f"`{action.option_strings[-1]}" not in listed]
    assert cli_docs.options(build_parser())  # the walk finds the top level's options
    assert not missing, missing


def test_every_variable_the_code_reads_is_listed():
    """A variable read with os.environ or os.getenv anywhere in streamserver/ or engines/ is one of
    cli_env.OWN (a flag's variable is read by cli_env itself, by name, never like this)."""
    read = re.compile(r"""(?:environ(?:\.get|\.setdefault)?\(?\[?|getenv\()\s*["'](STREAMSERVER_[A-Z_]+)["']""")
    names = set()
    for path in [*(ROOT / "streamserver").rglob("*.py"), *(ROOT / "engines").rglob("*.py")]:
        names |= set(read.findall(path.read_text(encoding="utf-8")))
    assert {"STREAMSERVER_SECRET", "STREAMSERVER_CACHE"} <= names  # the scan finds them
    assert not names - set(OWN), f"read from the environment but not in streamserver/cli_env.py OWN: {sorted(names - set(OWN))}"
    listed = set(re.findall(r"`(STREAMSERVER_[A-Z_]+)`", DOC.read_text(encoding="utf-8")))
    assert not set(OWN) - listed, sorted(set(OWN) - listed)
