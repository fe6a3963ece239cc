"""The docs' output samples (```text blocks: a line stratad writes) against lines the code
really writes here.

A sample matches a line when it does with its numbers, hashes, absolute paths and `...`
standing for any; a stage list (`= experts 47.89, attention 35.27 (ms)`) is ordered by time,
which varies by run, so both sides list their stages by name. The lines come from the store's
start on fakes (as tests/test_store_admission.py starts it), a pack with a damaged blob (read,
then served by a stratad without the model file it was made from) and the reference engine's
decode timing.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

_NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
_VARIABLE = re.compile(
    rf"""(?P<hex>\b(?=[0-9a-f]*\d)[0-9a-f]+(?:\.\.\.|…)        # a hash cut short: 9f0e...
         | \b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{{8,}}\b)  # a hash, a checksum
      | (?P<ellipsis>\.\.\.|…)
      | (?P<path>(?<![\w.])/(?:[\w.-]+/)+[\w.-]*\w)             # absolute, two parts or more
      | (?P<size>(?<![\w.]){_NUMBER}\ [KMGT]iB\b)                # sizes print in their unit
      | (?P<number>(?<![\w.]){_NUMBER})""",
    re.X,
)
_ANY = {"hex": "[0-9a-f]+", "ellipsis": ".*?", "path": r"\S+", "size": rf"{_NUMBER} [KMGT]iB",
        "number": _NUMBER}  # fmt: skip
_STAGES = re.compile(r"= ((?:[a-z][a-z ()]*? [\d.]+, )+[a-z][a-z ()]*? [\d.]+) \(ms\)")


def canonical(line: str) -> str:
    """One space between words; a stage list in the order of its names."""
    line = " ".join(line.split())
    return _STAGES.sub(lambda m: f"= {', '.join(sorted(m.group(1).split(', ')))} (ms)", line)


def sample_pattern(sample: str) -> re.Pattern[str]:
    """The sample (wrapped lines joined) as a pattern that matches the end of a log line."""
    text, parts, at = canonical(sample), [], 0
    for m in _VARIABLE.finditer(text):
        parts += [re.escape(text[at : m.start()]), _ANY[str(m.lastgroup)]]
        at = m.end()
    return re.compile("".join([*parts, re.escape(text[at:]), "$"]))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@contextlib.contextmanager
def _logged(name: str = "stratad") -> Iterator[list[str]]:
    """The records of logger `name` at INFO and above, as stratad writes them (less the time)."""
    handler, logger = _Lines(), logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def store_start_lines() -> list[str]:
    """The budget, the plan and full coverage; then, MemAvailable short, the wait, the degraded
    plan and coverage short of it (the fakes of tests/test_store_admission.py, no bytes held)."""
    from stratad.store.placement.plan import GiB
    from tests.test_store_admission import CONFIG, FakeClock, start

    with _logged() as lines:
        for available in (3 * GiB, int(1.5 * GiB)):
            start(CONFIG, available, FakeClock()).close()
    return lines


def damaged_pack_lines(gguf: Path, work: Path) -> list[str]:
    """A pack of `gguf` with a byte flipped in blob (0, 3): the error its read raises; then
    the line of a stratad that serves it with the model file it was made from gone."""
    from stratad.store.pack.manifest import EXPERTS_NAME, read_manifest
    from stratad.store.pack.write import write_pack
    from stratad.store.tiers.sources import BlobCorrupt, PackExperts
    from tests.daemon import free_port

    original, pack = work / "original.gguf", work / "damaged.pack"
    shutil.copyfile(gguf, original)
    write_pack(original, pack)
    blob = read_manifest(pack).blob(0, 3)
    with open(pack / EXPERTS_NAME, "r+b") as f:
        f.seek(blob.offset + blob.nbytes // 2)
        byte = f.read(1)[0]
        f.seek(blob.offset + blob.nbytes // 2)
        f.write(bytes([byte ^ 0x40]))
    import torch

    source = PackExperts(pack)
    try:
        source.read_into(0, 3, torch.empty(blob.nbytes, dtype=torch.uint8))
        raise AssertionError("a flipped byte went unnoticed")
    except BlobCorrupt as e:
        lines = [str(e)]
    finally:
        source.close()
    original.unlink()
    config = work / "stratad.toml"  # not the host's /etc/strata/stratad.toml
    config.write_text('[engine]\ndevice = "cpu"\nthreads = 1\n')
    r = subprocess.run(
        [sys.executable, "-m", "stratad", str(pack), "--config", str(config), "--port",
         str(free_port()), "--control-socket", str(work / "damaged.sock")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 65, f"exit {r.returncode}: {r.stderr}"
    return [*lines, *r.stderr.splitlines()]


def decode_timing_lines(gguf: Path) -> list[str]:
    """The reference engine's lines for one short request, `engine.decode_timing` on."""
    from stratad.config import override, parse_config
    from stratad.runtime.jobs import Job
    from stratad.runtime.service import Engine
    from stratad.store.store import ExpertStore

    config = parse_config(
        '[engine]\ndevice = "cpu"\nthreads = 1\nbackend = "reference"\ndecode_timing = true\n'
    )
    with _logged() as lines:
        engine = Engine(override(config, "model", path=str(gguf)))
        for _ in engine.run(Job(prompt="Hello there", max_tokens=4, temperature=0)):
            pass
        if isinstance(engine.store, ExpertStore):
            engine.store.close()
    return lines
