"""The launch settings of the offload engine's kernels, and the tuning-table file that holds them.

A table (`kernels.tuning.tables` names and selects it; `kernels.tuning.table_file` describes the
file) holds per shape bucket:

    "kernels": {"moe": {"block_n": 32, ...}, "moe_down": {...}, "fetch": {...},
                "attention": {...}, "dequant": {...}, "prefetch": {...}, "linear": {...}}

"moe" is the routed experts' gate/up launch and "moe_down" their down launch (a bucket without
"moe_down" runs down with "moe"'s settings, as before the two were apart). The launch a
projection wants depends on its GGUF type (each type has its own reader), so "moe@q4_k" or
"moe_down@q6_k" sets a launch for that type alone, on top of the launch's own settings: on
the H100, Q4_K gate/up ran 2.7x faster with 2 rows and one warp a program, where Q4_0's
reader ran 2.6x slower so (bench/results/2026-12-06-h100-r18.md). Any other kernel
missing from "kernels" keeps its defaults; an unknown kernel or setting, or a value
that is not a positive integer, is refused with the file and the key named, since a table
that half-applies is worse than none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from kernels.experts.expert_fetch import FetchConfig
from kernels.experts.moe import MOE_QTYPES, MoeConfig
from kernels.formats.dequant import DequantConfig
from kernels.formats.quant import QType
from kernels.layers.attention import AttentionConfig
from kernels.layers.linear import LinearConfig
from kernels.layers.qlinear import QLinearConfig
from kernels.tuning.table_file import TableFileError, buckets_of, nearest_bucket


@dataclass(frozen=True)
class KernelConfigs:
    moe: MoeConfig = MoeConfig()  # the routed experts' gate/up launch
    # their down launch: the transposed shape ([hidden, ffn]: more rows, shorter) may want
    # other settings
    moe_down: MoeConfig = MoeConfig()
    fetch: FetchConfig = FetchConfig()
    # decode over a static cache: up to 64 pieces of 64 positions per KV head, 32 per step,
    # 8 warps (H200, in a CUDA graph, 1K context in a 4K cache: 6.1 us; 16/32/4 warps 14.4)
    attention: AttentionConfig = AttentionConfig(block_s=32, split_s=64, num_warps=8)
    dequant: DequantConfig = DequantConfig()
    # the speculative copy (engine.prefetch) beside the compute: few programs, see its docs
    prefetch: FetchConfig = FetchConfig(programs=4)
    linear: LinearConfig = LinearConfig()  # decode's dense projections
    qlinear: QLinearConfig = QLinearConfig()  # the same read as GGUF blocks (dense_gguf)
    # a MoE launch's settings for one GGUF type: ("moe@q4_k", MoeConfig(...)), ...
    moe_by_type: tuple[tuple[str, MoeConfig], ...] = ()

    def moe_for(self, launch: str, qtype: QType, split: bool = False) -> MoeConfig:
        """The settings of MoE launch `launch` ("moe": gate/up, "moe_down") over a projection
        of `qtype`: the type's own where the table has them, else the launch's. `split`: the
        projection is held in its type's split layout (Q6_K's, `kernels.experts.moe.split_q6_k`),
        read by another reader: that layout's settings (`LAUNCH@q6_k_split`) come first."""
        key = f"{launch}@{qtype.name.lower()}"
        for wanted in (f"{key}{SPLIT_SUFFIX}", key) if split else (key,):
            for k, c in self.moe_by_type:  # a few entries: read on every eager MoE launch
                if k == wanted:
                    return c
        return getattr(self, launch)

    def moe_int8(self, qtype: QType, split: bool = False) -> bool:
        """Whether both MoE launches dot projections of `qtype` (held split, with `split`) in
        int8 (where aligned)."""
        return all(self.moe_for(launch, qtype, split).int8_dots for launch in MOE_LAUNCHES)


# Triton's interpreter (the CPU, in tests) runs each program as numpy operations, so fewer and
# wider programs run faster: a tiny model's expert matrices in one or two programs and one
# reduction step, and attention in two pieces (still merged) rather than one per 64 positions
# of the cache, cut an interpreted decode step 5-20 fold. The kernels' own tests run the GPU
# defaults against their references.
INTERPRETED = KernelConfigs(
    moe=MoeConfig(block_n=128, block_b=8),
    moe_down=MoeConfig(block_n=128, block_b=8),
    attention=AttentionConfig(block_s=32, split_s=64, max_splits=2),
    qlinear=QLinearConfig(block_n=1024),
)

KERNELS = tuple(f.name for f in fields(KernelConfigs) if f.name != "moe_by_type")
MOE_LAUNCHES = ("moe", "moe_down")
# a layout of a type with settings of its own: LAUNCH@TYPE_split (Q6_K's split layout)
SPLIT_SUFFIX = "_split"
SPLIT_TYPES = ("q6_k",)
# what `stratactl tune` measures; the prefetch copy's worth shows only beside the compute it
# overlaps (bench.gpu.e2e --prefetch), so a table sets it by hand
TUNED = ("moe", "fetch", "attention", "dequant", "linear")


class TuningTableError(ValueError):
    pass


def configs_from_json(
    data: Any, source: str = "table", shapes: Mapping[str, int] | None = None
) -> KernelConfigs:
    """The settings a table's JSON holds for the bucket nearest `shapes`, on top of the
    defaults."""
    try:
        bucket = nearest_bucket(buckets_of(data, source), shapes)
    except TableFileError as err:
        raise TuningTableError(str(err)) from None
    return configs_from_kernels(bucket.kernels, source)


def configs_from_kernels(kernels: Mapping[str, Any], source: str = "table") -> KernelConfigs:
    """One bucket's {kernel: {setting: value}} on top of the defaults."""
    out = KernelConfigs()
    by_type = {}
    for name, settings in kernels.items():
        launch, _, type_name = name.partition("@")
        if type_name:
            _moe_type(launch, type_name, name, source)
            by_type[name] = settings
            continue
        if name not in KERNELS:
            raise TuningTableError(
                f"{source}: unknown kernel {name!r} (known: {', '.join(KERNELS)},"
                f" and {' or '.join(MOE_LAUNCHES)}@TYPE)"
            )
        out = replace(out, **{name: _settings(getattr(out, name), name, settings, source)})
    if "moe" in kernels and "moe_down" not in kernels:
        out = replace(out, moe_down=out.moe)
    typed = tuple(
        (name, _settings(getattr(out, name.partition("@")[0]), name, settings, source))
        for name, settings in sorted(by_type.items())
    )
    return replace(out, moe_by_type=typed)


def _moe_type(launch: str, type_name: str, name: str, source: str) -> None:
    if launch not in MOE_LAUNCHES:
        raise TuningTableError(
            f"{source}: {name!r}: only {' and '.join(MOE_LAUNCHES)} take settings per type"
        )
    known = sorted(q.name.lower() for q in MOE_QTYPES)
    known += [f"{t}{SPLIT_SUFFIX}" for t in SPLIT_TYPES]
    if type_name not in known:
        raise TuningTableError(
            f"{source}: {name!r}: {type_name!r} is no type the MoE kernels read"
            f" (known: {', '.join(known)})"
        )


def _settings(default: Any, name: str, settings: Any, source: str) -> Any:
    """`default` with a table's settings for kernel `name` (checked: known keys, switches true
    or false, the rest positive integers)."""
    known = {f.name for f in fields(default)}
    if not isinstance(settings, dict):
        raise TuningTableError(f"{source}: kernels.{name} is not an object")
    for key, value in settings.items():
        if key not in known:
            raise TuningTableError(
                f"{source}: unknown setting kernels.{name}.{key}"
                f" (known: {', '.join(sorted(known))})"
            )
        if isinstance(getattr(default, key), bool):  # a switch (MoeConfig.int8_dots)
            if not isinstance(value, bool):
                raise TuningTableError(
                    f"{source}: kernels.{name}.{key} = {value!r} is not true or false"
                )
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TuningTableError(
                f"{source}: kernels.{name}.{key} = {value!r} is not a positive integer"
            )
    return replace(default, **settings)


def configs_to_json(configs: KernelConfigs) -> dict[str, dict[str, int]]:
    out = {name: asdict(getattr(configs, name)) for name in KERNELS}
    return out | {name: asdict(cfg) for name, cfg in configs.moe_by_type}


def load_configs(path: Path, shapes: Mapping[str, int] | None = None) -> KernelConfigs:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise TuningTableError(f"{path}: cannot read the table ({err})") from err
    return configs_from_json(data, str(path), shapes)
