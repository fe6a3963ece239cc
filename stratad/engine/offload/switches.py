"""The offload engine's kernel-path switches, each set by the configuration, else by the A/B/A
run recorded in this GPU's tuning table (`kernels.tuning.ab`, `bench.gpu.ab_switch`), else by a
built-in default. Pure functions of the engine section and the table's `switches`, so the placement
(which sizes the fetch staging by them) and the engine choose alike.

- `gpu_miss`: how the GPU gets a decode step's missed experts, `copy` (a fetch kernel into VRAM
  staging) or `in_place` (the fused kernel reads page-locked RAM over PCIe).
- `expert_prefetch`: guess each layer's experts a layer early and copy the guesses (`on`/`off`;
  copy path only).
- `cpu_split`: `pcie_frac = auto` gives the CPU its balanced share of the misses (`balanced`),
  or keeps every miss on the GPU (`off`): a split step runs without its CUDA graph.
- `q6_k_layout`: the experts' Q6_K projections held as GGUF blocks (`blocks`, 2-byte aligned
  words read as halves) or in the split layout (`split`: 16-byte words, which the GPU's int8
  dots alone read; the compiled CPU kernels read either).
- `dense_form`: the attention's (and linear attention's) in and out projections and the output
  head dequantized once (`bf16`: the compute dtype) or held as their GGUF blocks alone (`gguf`:
  decode dots them in int8, prefill dequantizes slices as it goes), where the int8 dots read
  their types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kernels.formats.quant import QType
from kernels.tuning.configs import KernelConfigs
from stratad.config import EngineConfig

TableSwitches = Mapping[str, str | int | bool]

GPU_MISS = ("copy", "in_place")
ON_OFF = ("on", "off")
CPU_SPLIT = ("off", "balanced")
Q6_K_LAYOUT = ("blocks", "split")
DENSE_FORM = ("bf16", "gguf")


@dataclass(frozen=True)
class Chosen:
    """One switch's setting and where it came from (for the start line)."""

    value: str
    source: str  # "engine.gpu_miss", "table sm90-cuda-13.0 (A/B/A)", "default" ...

    def __str__(self) -> str:
        return f"{self.value} ({self.source})"


@dataclass(frozen=True)
class MissPaths:
    """The decode miss paths the offload engine runs."""

    gpu_miss: Chosen
    prefetch: Chosen
    cpu_split: Chosen

    @property
    def copy(self) -> bool:
        return self.gpu_miss.value == "copy"

    @property
    def prefetching(self) -> bool:
        return self.prefetch.value == "on"

    @property
    def balanced(self) -> bool:
        return self.cpu_split.value == "balanced"

    def line(self) -> str:
        return (f"kernel paths: gpu_miss {self.gpu_miss}, expert_prefetch {self.prefetch},"
                f" cpu_split {self.cpu_split}")


def _pick(switches: TableSwitches, table: str, name: str, allowed: tuple[str, ...],
          default: str) -> Chosen:  # fmt: skip
    """A switch as the table records it, else its built-in default."""
    raw = switches.get(name)
    if raw is None:
        return Chosen(default, "default")
    found = ("on" if raw else "off") if isinstance(raw, bool) else str(raw)
    if found not in allowed:  # a table from another version of this program
        return Chosen(default, f"default; table {table}'s {found!r} is not a setting")
    return Chosen(found, f"table {table} (A/B/A)")


def q6_k_layout(switches: TableSwitches, configs: KernelConfigs, table: str = "") -> Chosen:
    """How the experts hold their Q6_K projections (`Q6_K_LAYOUT`): the table's recorded
    choice, else `blocks`; `blocks` too where `configs` do not dot Q6_K in int8 in both MoE
    launches (the split layout's only reader)."""
    chosen = _pick(switches, table, "q6_k_layout", Q6_K_LAYOUT, "blocks")
    if chosen.value == "split" and not configs.moe_int8(QType.Q6_K, split=True):
        return Chosen("blocks", f"{chosen.source} asks split, but Q6_K's int8 dots are off")
    return chosen


def dense_form(switches: TableSwitches, table: str = "") -> Chosen:
    """How the dense projections are held (`DENSE_FORM`): the table's recorded choice, else
    `bf16`."""
    return _pick(switches, table, "dense_form", DENSE_FORM, "bf16")


def miss_paths(engine: EngineConfig, switches: TableSwitches, table: str = "") -> MissPaths:
    """Each switch: the engine section's explicit setting, else the table's recorded default,
    else the built-in one. An explicit `expert_prefetch = true` needs (and sets) the copy
    path."""

    def pick(name: str, allowed: tuple[str, ...], default: str) -> Chosen:
        return _pick(switches, table, name, allowed, default)

    if engine.gpu_miss != "auto":
        gpu_miss = Chosen(engine.gpu_miss, "engine.gpu_miss")
    elif engine.expert_prefetch is True:
        gpu_miss = Chosen("copy", "expert_prefetch = true needs it")
    else:
        gpu_miss = pick("gpu_miss", GPU_MISS, "copy")
    if gpu_miss.value != "copy":
        prefetch = Chosen("off", f"gpu_miss {gpu_miss.value}")
    elif engine.expert_prefetch != "auto":
        prefetch = Chosen("on" if engine.expert_prefetch else "off", "engine.expert_prefetch")
    else:
        prefetch = pick("expert_prefetch", ON_OFF, "on")
    if engine.pcie_frac == "balanced":
        split = Chosen("balanced", "engine.pcie_frac")
    elif engine.pcie_frac != "auto":
        split = Chosen(f"pcie_frac {engine.pcie_frac:g}", "engine.pcie_frac")
    else:
        split = pick("cpu_split", CPU_SPLIT, "off")
    return MissPaths(gpu_miss, prefetch, split)
