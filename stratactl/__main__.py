"""stratactl: one sub-command per verb family; each module registers its own parser.

Nothing here imports torch at start: a verb that needs it imports it when it runs. A module
provides `add_parser(subparsers)` (one or more verbs) and `run(args) -> int`; the verb runs
the `run` of the module that registered it (or a `func`/`run` the parser set as a default).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Any

# verb modules; each provides add_parser(subparsers) and run(args) -> int
VERB_MODULES = (
    "stratactl.daemon",  # status, coverage, plan, stats, profile-save, drain, undrain
    "stratactl.check",  # check [--after-restart]
    "stratactl.logs",  # logs
    "stratactl.tables",  # tables select
    "stratactl.tune",  # tune (writes a table)
    "stratactl.doctor",  # doctor (a bug report)
    "stratactl.bench",  # bench kernels (each kernel against the device's ceilings)
    "stratactl.synth",
    "stratactl.pack",
)


class _Recording:
    """Wraps the subparsers action to note which module registered each verb."""

    def __init__(self, sub: Any, owners: dict[str, ModuleType]) -> None:
        self._sub = sub
        self._owners = owners
        self.module: ModuleType | None = None

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        assert self.module is not None
        self._owners[name] = self.module
        return self._sub.add_parser(name, **kwargs)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sub, name)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, ModuleType]]:
    p = argparse.ArgumentParser(prog="stratactl", description="Operate a Strata daemon.")
    sub = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    owners: dict[str, ModuleType] = {}
    recording = _Recording(sub, owners)
    for name in VERB_MODULES:
        module = importlib.import_module(name)
        recording.module = module
        module.add_parser(recording)
    return p, owners


def main(argv: list[str] | None = None) -> int:
    parser, owners = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "func", None) or getattr(args, "run", None) or owners[args.verb].run
    try:
        return int(run(args))
    except KeyboardInterrupt:
        print("stratactl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `stratactl logs | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
