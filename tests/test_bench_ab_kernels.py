"""bench.cpu.ab_kernels: another revision's CPU kernel sources built and loaded beside this
tree's, timed in turns, their bits compared (one small layer: the plumbing, not the figures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cpu.ab_kernels import main, sources
from kernels.cpu.build import MAIN


def test_two_revisions_in_one_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ab.json"
    main(["HEAD", ".", "--layers", "1", "--cases", "8:2,0:3", "--rounds", "2", "--threads", "2",
          "--json", str(out)])  # fmt: skip
    got = json.loads(out.read_text())
    assert got["revisions"] == ["HEAD", "."] and set(got["cases"]) == {"8:2", "0:3"}
    for case in got["cases"].values():
        assert case["same_bits"] is True
        assert all(len(ms) == 2 and min(ms) > 0 for ms in case["ms"].values())
    assert "| 8:2 |" in capsys.readouterr().out


def test_a_revision_is_its_committed_sources(tmp_path: Path) -> None:
    folder = sources("HEAD", tmp_path)
    assert (folder / MAIN).is_file() and any(folder.glob("*.h"))
    with pytest.raises(SystemExit, match="git archive no-such-rev"):
        sources("no-such-rev", tmp_path)


def test_bad_cases_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["HEAD", "--cases", "8-2"])
    with pytest.raises(SystemExit):
        main(["HEAD", "--cases", "8:0"])
    with pytest.raises(SystemExit):
        main(["HEAD", "--qtype", "Q9_9"])
