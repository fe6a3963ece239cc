"""The configuration reference and example file are generated from the config definition, and
the operator docs name what operators look for."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from stratad import configdoc
from stratad.config import Config, parse_config

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_configuration_md_and_example_are_current() -> None:
    assert configdoc.undocumented() == []
    assert configdoc.DOC_PATH.read_text() == configdoc.render_markdown(), (
        "docs/configuration.md is stale: python -m stratad.configdoc --write")
    assert configdoc.EXAMPLE_PATH.read_text() == configdoc.render_example(), (
        "systemd/stratad.toml is stale: python -m stratad.configdoc --write")


def test_every_key_and_variable_is_in_the_reference() -> None:
    text = configdoc.DOC_PATH.read_text()
    for section in msgspec.structs.fields(Config):
        assert f"## [{section.name}]" in text
        for f in msgspec.structs.fields(section.type):
            assert f"| `{f.name}` |" in text, f"{section.name}.{f.name}"
    for name, _ in configdoc.env_vars():
        assert f"| `{name}` |" in text


def test_example_file_parses_to_the_defaults_commented_and_uncommented() -> None:
    example = configdoc.EXAMPLE_PATH.read_text()
    assert parse_config(example) == Config()
    uncommented = re.sub(r"^# (\w+ = )", r"\1", example, flags=re.M)
    assert uncommented != example and parse_config(uncommented) == Config()


def test_amd_doc_covers_headroom_retuning_and_tables() -> None:
    text = (DOCS / "AMD_HIP.md").read_text()
    assert "STRATA_RESIDENT_HEADROOM_GIB" in text and "re-tuning when the ROCm version" in text
    assert "stratactl tables select" in text and "<arch>-<backend>-<version>.json" in text
    assert "stratactl coverage" in text


def test_operations_doc_covers_units_containers_and_log_lines() -> None:
    text = (DOCS / "operations.md").read_text()
    for needle in ("Type=notify", "ExecStartPre=stratactl check", "LimitMEMLOCK=infinity",
                   "--ulimit memlock=-1", "HEALTHCHECK", "lxc.prlimit.memlock",
                   "STRATA_EVENT", "landed SHORT", "How to read coverage"):
        assert needle in text, needle
    from stratactl.__main__ import build_parser

    verbs = set(build_parser()[1])
    for verb in verbs - {"synth", "pack", "tune", "bench"}:
        assert f"stratactl {verb}" in text, verb
