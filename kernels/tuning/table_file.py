"""What a kernel tuning table file holds: a header, one or more shape buckets, switch defaults.

Selection (`kernels.tuning.tables`) picks the file for a GPU stack; this module reads it (no torch):

    {"key": "sm90-cuda-13.0",
     "header": {"arch": "sm90", "backend": "cuda", "runtime": "13.0",   # must agree with key
                "triton": "3.5.0", "torch": "2.9.0+cu130", "device": "NVIDIA H200",
                "mismatch_cost": "decode -4%, prefill -11% with this table on cuda 12.8"},
     "buckets": [{"shapes": {"hidden": 2048, "ffn": 768, "top_k": 8, ...},
                  "kernels": {"moe": {"block_n": 32, ...}, ...},
                  "measured_us": {"moe": {"default_us": 9.1, "best_us": 7.8}, ...}}, ...],
     "switches": {"gpu_miss": {"value": "in_place", "ab": {...}}}}

A table written before buckets existed (`"kernels"`, `"shapes"`, `"measured_us"` at the top,
no header) reads as one bucket with a header taken from its name. A model whose shapes fall
between buckets takes the nearest (the smallest summed log2 ratio over the sizes both name).
`switches` hold per-architecture defaults of the kernel paths that have a switch, each from a
recorded A/B/A run (`kernels.tuning.ab`): the value, and the run's verdict that justified it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TableFileError(ValueError):
    """A table file that cannot be used: the file and the key are named."""


@dataclass(frozen=True)
class Header:
    arch: str
    backend: str
    runtime: str  # the runtime version: ROCm major.minor.patch, CUDA major.minor
    triton: str | None = None
    torch: str | None = None
    device: str | None = None  # the GPU's name, as the runtime reports it
    mismatch_cost: str | None = None  # measured cost of this table on another runtime version

    @property
    def key(self) -> str:
        return f"{self.arch}-{self.backend}-{self.runtime}"


@dataclass(frozen=True)
class Bucket:
    shapes: Mapping[str, int]  # the model shapes the settings were measured at
    kernels: Mapping[str, Any]  # kernel -> {setting: value}, read by kernels.tuning.configs
    measured_us: Mapping[str, Any] = field(default_factory=dict)

    def distance(self, shapes: Mapping[str, int]) -> float:
        """How far a model's shapes are from this bucket's: summed |log2 ratio| over the sizes
        both name (a bucket that names none fits every model equally)."""
        common = [k for k in self.shapes if k in shapes and self.shapes[k] > 0 and shapes[k] > 0]
        return sum(abs(math.log2(shapes[k] / self.shapes[k])) for k in common)


@dataclass(frozen=True)
class Switch:
    value: str | int | bool
    # the A/B/A run's record (kernels.tuning.ab)
    ab: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TableFile:
    key: str
    header: Header
    buckets: tuple[Bucket, ...]
    switches: Mapping[str, Switch] = field(default_factory=dict)

    def bucket_for(self, shapes: Mapping[str, int] | None) -> Bucket:
        return nearest_bucket(self.buckets, shapes)

    @property
    def switch_values(self) -> dict[str, str | int | bool]:
        return {name: s.value for name, s in self.switches.items()}


def parse(data: Any, key: str, source: str = "table") -> TableFile:
    """A table's JSON as a TableFile; `key` is the stack its file name says."""
    header = header_of(data, key, source)
    buckets = buckets_of(data, source)
    switches = data.get("switches", {})
    if not isinstance(switches, dict):
        raise TableFileError(f"{source}: \"switches\" is not an object")
    return TableFile(key, header, buckets, {n: _switch(s, f"{source}: switches.{n}")
                                            for n, s in switches.items()})


def header_of(data: Any, key: str, source: str = "table") -> Header:
    """The header, checked against the stack the file is named for (a table that says it was
    tuned for another stack is refused: its name was changed by hand)."""
    if not isinstance(data, dict):
        raise TableFileError(f"{source}: not a JSON object")
    declared = data.get("key", key)
    if declared != key:
        raise TableFileError(f"{source} is named for {key} but says it was tuned for {declared}")
    arch, backend, runtime = key.split("-", 2)
    device = data.get("device") if isinstance(data.get("device"), str) else None
    header = _header(data.get("header", {}), source, Header(arch, backend, runtime,
                                                             device=device))
    if header.key != key:
        raise TableFileError(f"{source} is named for {key} but its header says {header.key}")
    return header


def buckets_of(data: Any, source: str = "table") -> tuple[Bucket, ...]:
    if not isinstance(data, dict):
        raise TableFileError(f"{source}: not a JSON object")
    if "buckets" in data:
        raw = data["buckets"]
        if not isinstance(raw, list) or not raw:
            raise TableFileError(f"{source}: \"buckets\" is not a non-empty list")
        return tuple(_bucket(b, f"{source}: buckets[{i}]") for i, b in enumerate(raw))
    # the one-bucket format `stratactl tune` wrote first
    return (_bucket({k: data[k] for k in ("shapes", "kernels", "measured_us") if k in data},
                    source),)


def nearest_bucket(buckets: tuple[Bucket, ...], shapes: Mapping[str, int] | None) -> Bucket:
    """The bucket measured nearest to `shapes` (the first one when no shapes are given)."""
    if shapes is None:
        return buckets[0]
    return min(buckets, key=lambda b: b.distance(shapes))


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise TableFileError(f"{path}: cannot read the table ({err})") from err


def read(path: Path, key: str) -> TableFile:
    return parse(load(path), key, str(path))


def _header(raw: Any, source: str, default: Header) -> Header:
    if not isinstance(raw, dict):
        raise TableFileError(f"{source}: \"header\" is not an object")
    known = set(Header.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TableFileError(f"{source}: unknown header field {', '.join(unknown)}")
    bad = [k for k, v in raw.items() if not isinstance(v, str)]
    if bad:
        raise TableFileError(f"{source}: header.{bad[0]} is not a string")
    values = {k: getattr(default, k) for k in known}
    values.update(raw)
    return Header(**values)


def _bucket(raw: Any, where: str) -> Bucket:
    if not isinstance(raw, dict):
        raise TableFileError(f"{where} is not an object")
    kernels = raw.get("kernels")
    if not isinstance(kernels, dict):
        raise TableFileError(f"{where}: no \"kernels\" object")
    shapes = raw.get("shapes", {})
    if not isinstance(shapes, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in shapes.values()
    ):
        raise TableFileError(f"{where}: \"shapes\" is not an object of integers")
    measured = raw.get("measured_us", {})
    return Bucket(shapes, kernels, measured if isinstance(measured, dict) else {})


def _switch(raw: Any, where: str) -> Switch:
    if not isinstance(raw, dict) or not isinstance(raw.get("value"), str | int | bool):
        raise TableFileError(f"{where}: expected {{\"value\": ..., \"ab\": {{...}}}}")
    ab = raw.get("ab", {})
    return Switch(raw["value"], ab if isinstance(ab, dict) else {})
