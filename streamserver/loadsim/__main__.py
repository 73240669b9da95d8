"""`python -m streamserver.loadsim ...`: the loadsim command on its own, with the same options
as `streamserver loadsim`."""

from __future__ import annotations

import argparse

from streamserver.loadsim.cli import DESCRIPTION, configure


def main() -> int:
    args = configure(argparse.ArgumentParser(prog="python -m streamserver.loadsim", description=DESCRIPTION)).parse_args()
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
