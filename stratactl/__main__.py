"""stratactl: one sub-command per verb family; each module registers its own parser.

Nothing here imports torch at start: a verb that needs it imports it when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# verb module -> it provides add_parser(subparsers) and run(args) -> int
VERB_MODULES = ("stratactl.synth",)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stratactl", description="Operate a Strata daemon.")
    sub = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name in VERB_MODULES:
        importlib.import_module(name).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print("stratactl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
