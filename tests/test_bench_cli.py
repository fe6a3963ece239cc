"""The GPU benchmark drivers run only on a GPU; here, their command lines are checked so that a
flag the code reads but the parser lacks fails in CI rather than on the GPU machine."""

from __future__ import annotations

import re
from pathlib import Path

import bench.gpu.e2e


def test_every_argument_e2e_reads_is_parsed() -> None:
    source = Path(bench.gpu.e2e.__file__).read_text()
    used = set(re.findall(r"\bargs\.([a-z_][a-z0-9_]*)", source))
    parsed = {a.dest for a in bench.gpu.e2e.parser()._actions}
    assert used and used <= parsed, f"read but not parsed: {sorted(used - parsed)}"
    args = bench.gpu.e2e.parser().parse_args(
        ["--model", "m.gguf", "--no-prefetch", "--kernel-table", "t.json", "--gpu-miss", "in_place"]
    )
    assert (
        args.prefetch == "off"
        and args.kernel_table == "t.json"  # a file, or "builtin" (configs_for_run)
        and args.gpu_miss == "in_place"
    )


def test_the_cache_fits_every_prompt_the_run_makes() -> None:
    """--profile prefills a 4,096-token chunk even when the prefill lengths are shorter."""
    short = ["--model", "m.gguf", "--prefill-lens", "1024"]
    assert bench.gpu.e2e.context_needed(bench.gpu.e2e.parser().parse_args(short)) >= 1024 + 256
    profiled = bench.gpu.e2e.parser().parse_args([*short, "--profile"])
    assert bench.gpu.e2e.context_needed(profiled) >= 4096 + 8


def test_http_clients_settings_land_in_their_sections() -> None:
    """`bench.http.http_clients --set` gives the daemon a GPU's expert budget or a context: each
    setting in its section, the benchmark's own kept unless overridden, a malformed one
    refused before a daemon starts."""
    import pytest

    from bench.http.http_clients import config_text, tomllib
    from stratad.config import parse_config

    text = config_text(8, ["store.expert_cache=1392", "model.max_context=1024",
                           "server.parallel=16"])  # fmt: skip
    raw = tomllib.loads(text)
    assert raw["store"] == {"expert_cache": 1392}
    assert raw["model"] == {"aliases": ["m"], "max_context": 1024}
    assert raw["server"]["parallel"] == 16 and raw["server"]["max_queue"] == 256
    assert parse_config(text).store.expert_cache == 1392  # the daemon reads it as written
    for bad in ["expert_cache=3", "store.expert_cache", "store.=1", "store.x=not toml"]:
        with pytest.raises((ValueError, tomllib.TOMLDecodeError)):
            config_text(1, [bad])


def test_http_clients_summary_is_the_median_of_its_rounds() -> None:
    """`--rounds 3` reports each (parallel, clients) pair once: the median of its rounds, with
    their lowest and highest beside it, pairs kept apart."""
    from bench.http.http_clients import markdown, summarize

    def rnd(parallel: int, clients: int, rate: float) -> dict[str, float]:
        return {"parallel": parallel, "clients": clients, "tokens_per_s": rate,
                "latency_s": rate / 100, "first_token_s": rate / 1000}  # fmt: skip

    rounds = [rnd(8, 1, 50.0), rnd(8, 1, 40.0), rnd(8, 1, 45.0), rnd(8, 8, 300.0),
              rnd(8, 8, 320.0), rnd(8, 8, 280.0)]  # fmt: skip
    rows = summarize(rounds)
    assert [(r["clients"], r["tokens_per_s"], r["spread"], r["rounds"]) for r in rows] == [
        (1, 45.0, [40.0, 50.0], 3), (8, 300.0, [280.0, 320.0], 3)]
    text = markdown({"model": "m.gguf", "max_tokens": 128, "requests": 2, "rounds_each": 3,
                     "summary": rows})  # fmt: skip
    assert "| 8 | 8 | 300.0 | 280.0–320.0 |" in text and "median of 3 rounds" in text


def test_moe_types_settings_round_trip_through_their_tags() -> None:
    """A `--configs` setting reads back from its own tag, block_b (`:bN`) included, and a
    flag the sweep does not know is refused."""
    import argparse

    import pytest

    from bench.gpu.moe_types import FORMATS, _config, config_tag
    from kernels.formats.quant import QType

    for text in ("4:1:1", "8:2:4:i8:ng", "16:1:4:b8", "2:1:2:ng:b64"):
        cfg = _config(text)
        assert _config(config_tag(cfg)) == cfg
    assert _config("16:1:4:b8").block_b == 8
    assert config_tag(_config("16:1:4:b32")) == "16:1:4"  # the default is left out
    for bad in ("4:1:1:b", "4:1:1:x", "4:1:1:b8:b16"):
        with pytest.raises(argparse.ArgumentTypeError):
            _config(bad)
    assert FORMATS["mxfp4"] == (QType.MXFP4,) * 3
