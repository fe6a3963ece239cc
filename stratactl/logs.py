"""`stratactl logs [TOPIC...]`: the daemon's log lines that operators look for.

Topics: coverage (how many experts keep a RAM copy, and the cost when not all do), warnings
(every WARNING and worse), timing (stage timings), plan (the residency plan and its hash).
Reads the journal (systemd-python's reader; the unit's entries, or a directory of journal
files copied from another host) or a log file (`--file`, `-` for stdin, e.g.
`docker logs stratad 2>&1 | stratactl logs coverage --file -`). On a host without a journal
and without `--file` it says where the daemon's log goes instead and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

import msgspec

from stratactl.client import fail
from stratad.systemd import EVENT_FIELD, classify

TOPICS = ("coverage", "warnings", "timing", "plan")
_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}
# journald PRIORITY -> logging level
_PRIORITIES = {0: 50, 1: 50, 2: 50, 3: 40, 4: 30, 5: 20, 6: 20, 7: 10}
# the daemon's stream format: "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LINE = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:[,.]\d+)? (?P<level>[A-Z]+) (?P<name>\S+): "
    r"(?P<message>.*)$"
)
JOURNAL_DIRS = (Path("/var/log/journal"), Path("/run/log/journal"))


class Entry(msgspec.Struct, frozen=True):
    time: datetime | None
    level: int
    logger: str
    message: str
    event: str | None

    def matches(self, topics: Iterable[str]) -> bool:
        for topic in topics:
            if topic == "warnings" and self.level >= logging.WARNING:
                return True
            if topic != "warnings" and self.event == topic:
                return True
        return False

    def render(self) -> str:
        when = self.time.strftime("%Y-%m-%d %H:%M:%S") if self.time else "-"
        return f"{when} {logging.getLevelName(self.level)} {self.logger}: {self.message}"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("logs", help="the daemon's coverage, warning, timing, plan lines",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("topics", nargs="*", metavar="TOPIC",
                   help=f"any of {', '.join(TOPICS)} (default: all)")
    p.add_argument("--since", help="e.g. 30m, 2h, 1d, or 2025-01-31 08:00")
    p.add_argument("--unit", default="stratad.service",
                   help="systemd unit (default stratad.service)")
    p.add_argument("--journal-dir", type=Path,
                   help="read journal files from this directory instead of the system journal")
    p.add_argument("--file", help="read this log file instead of the journal (- for stdin)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def parse_since(text: str, now: datetime | None = None) -> datetime:
    now = now or datetime.now()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd])", text.strip())
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m[2]]
        return now - timedelta(**{unit: float(m[1])})
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"--since {text!r}: expected e.g. 30m, 2h, 1d or 2025-01-31 08:00"
        ) from None


def read_file(stream: TextIO) -> Iterator[Entry]:
    """Entries of the daemon's stream format; continuation lines join the entry before."""
    current: dict[str, Any] | None = None
    for raw in stream:
        line = raw.rstrip("\n")
        m = _LINE.match(line)
        if m is None or m["level"] not in _LEVELS:
            if current is not None:
                current["message"] += "\n" + line
            continue
        if current is not None:
            yield _entry(current)
        current = {"time": datetime.fromisoformat(m["time"].replace("T", " ")),
                   "level": _LEVELS[m["level"]], "logger": m["name"], "message": m["message"]}
    if current is not None:
        yield _entry(current)


def _entry(d: dict[str, Any]) -> Entry:
    first = d["message"].split("\n", 1)[0]
    return Entry(d["time"], d["level"], d["logger"], d["message"],
                 classify(d["logger"], d["level"], first))


def read_journal(unit: str, directory: Path | None, since: datetime | None) -> Iterator[Entry]:
    # systemd-python (a declared dependency: the `systemd` extra)
    journal = importlib.import_module("systemd.journal")

    reader = journal.Reader(path=str(directory)) if directory else journal.Reader()
    reader.add_match(_SYSTEMD_UNIT=unit)
    reader.add_disjunction()
    reader.add_match(SYSLOG_IDENTIFIER=unit.removesuffix(".service"))
    if since is not None:
        reader.seek_realtime(since)
    for e in reader:
        message = e.get("MESSAGE", "")
        if isinstance(message, bytes):
            message = message.decode(errors="replace")
        level = _PRIORITIES.get(int(e.get("PRIORITY", 6)), 20)
        logger = str(e.get("LOGGER", e.get("SYSLOG_IDENTIFIER", "stratad")))
        event = e.get(EVENT_FIELD) or classify(logger, level, message)
        when = e.get("__REALTIME_TIMESTAMP")
        yield Entry(when.replace(tzinfo=None) if when else None, level, logger, message, event)


# Where the daemon's log goes on a host without a journal, for those who look for it there.
NO_JOURNAL = (
    "no systemd journal on this host: stratad writes its log to its standard error (the"
    " terminal it runs in, `docker logs`, or the file its service manager sends it to)"
)


def journal_present() -> bool:
    """Whether this host keeps a systemd journal (files under /var/log or /run/log)."""
    return any(d.is_dir() and any(d.iterdir()) for d in JOURNAL_DIRS)


def run(args: argparse.Namespace) -> int:
    topics = args.topics or list(TOPICS)
    unknown = [t for t in topics if t not in TOPICS]
    if unknown:
        return fail(f"unknown topic {', '.join(unknown)}; topics: {', '.join(TOPICS)}")
    try:
        since = parse_since(args.since) if args.since else None
    except ValueError as e:
        return fail(str(e))
    entries: Iterable[Entry]
    stream: TextIO | None = None
    if args.file:
        try:
            stream = sys.stdin if args.file == "-" else open(args.file, errors="replace")  # noqa: SIM115
        except OSError as e:
            return fail(f"{args.file}: {e.strerror}")
        entries = read_file(stream)
    elif args.journal_dir or journal_present():
        entries = read_journal(args.unit, args.journal_dir, since)
    else:  # nothing is wrong: the lines are elsewhere
        print(f"{NO_JOURNAL}; read it with --file PATH (- for stdin, e.g."
              " `docker logs stratad 2>&1 | stratactl logs --file -`)", file=sys.stderr)
        return 0
    try:
        for entry in _filtered(entries, topics, since):
            if args.json:
                sys.stdout.write(msgspec.json.encode(entry).decode() + "\n")
            else:
                print(entry.render())
    finally:
        if stream is not None and stream is not sys.stdin:
            stream.close()
    return 0


def _filtered(
    entries: Iterable[Entry], topics: list[str], since: datetime | None
) -> Iterator[Entry]:
    for entry in entries:
        if since is not None and entry.time is not None and entry.time < since:
            continue
        if entry.matches(topics):
            yield entry
