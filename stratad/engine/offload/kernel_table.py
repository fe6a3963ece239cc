"""Which launch settings the offload engine's kernels use: the tuning table for this GPU stack
(`kernels.tuning.tables`: the exact one, else the nearest runtime version's with a WARNING), at the
shape bucket nearest the model's, else the kernels' defaults. One log line at start says which,
and what a missing table costs."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kernels.tuning import table_file, tables
from kernels.tuning.configs import (
    INTERPRETED,
    KernelConfigs,
    TuningTableError,
    configs_from_kernels,
    load_configs,
)
from stratad.model.spec import ModelSpec

log = logging.getLogger("stratad.engine")


@dataclass(frozen=True)
class Lookup:
    """What the engine runs with, and the one line that says why."""

    configs: KernelConfigs
    level: int  # INFO: the exact table, or the defaults; WARNING: another version's, or refused
    message: str
    choice: tables.Choice | None = None
    shapes: Mapping[str, int] = field(default_factory=dict)  # the bucket used (empty: none)
    switches: Mapping[str, str | int | bool] = field(default_factory=dict)  # A/B/A defaults

    @property
    def table(self) -> str:
        """The table file's name without .json ("" for none)."""
        path = self.choice.path if self.choice is not None else None
        return path.name.removesuffix(".json") if path is not None else ""


def lookup(
    stack: tables.Stack,
    shapes: Mapping[str, int] | None = None,
    dirs: Sequence[Path] = tables.SEARCH_PATH,
) -> Lookup:
    """The table for one stack at the bucket nearest `shapes`: a pure function of the tables
    in `dirs`."""
    choice = tables.select(stack, dirs)
    if choice.path is None:
        level = logging.WARNING if choice.reason == "refused" else logging.INFO
        return Lookup(KernelConfigs(), level, choice.message, choice)
    try:
        table = table_file.read(choice.path, choice.path.name.removesuffix(".json"))
        bucket = table.bucket_for(shapes)
        configs = configs_from_kernels(bucket.kernels, str(choice.path))
    except (table_file.TableFileError, TuningTableError) as err:
        return Lookup(KernelConfigs(), logging.WARNING, f"{err}: refused; {tables.COST}", choice)
    where = f" (bucket {_fmt_shapes(bucket.shapes)})" if len(table.buckets) > 1 else ""
    level = logging.INFO if choice.exact else logging.WARNING
    return Lookup(configs, level, f"kernel tuning table {choice.message}{where}", choice,
                  bucket.shapes, table.switch_values)  # fmt: skip


@dataclass(frozen=True)
class Shapes:
    """The shapes a tuning table's buckets are keyed by (`stratactl tune` measures at them)."""

    hidden: int
    ffn: int  # one expert's
    top_k: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int = 128  # the router's rows
    context: int = 1024
    cache: int = 4096  # the daemon's default max_context

    @classmethod
    def of(cls, spec: ModelSpec) -> Shapes:
        return cls(spec.hidden, spec.expert_ffn, spec.n_experts_used, spec.n_heads,
                   spec.n_kv_heads, spec.head_dim, spec.n_experts)  # fmt: skip

    @property
    def qkv_rows(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def gate_bytes(self) -> int:
        return self.ffn * (self.hidden // 32) * 18


def configs_for(
    stack: tables.Stack, dirs: Sequence[Path] = tables.SEARCH_PATH
) -> tuple[KernelConfigs, int, str]:
    """(settings, log level, message) for one stack, at the table's first bucket."""
    found = lookup(stack, None, dirs)
    return found.configs, found.level, found.message


def model_shapes(spec: ModelSpec) -> dict[str, int]:
    """A model's shapes under the names a table's buckets use (what `stratactl tune` writes)."""
    return asdict(Shapes.of(spec))


def _fmt_shapes(shapes: Mapping[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in shapes.items()) or "-"


def this_stack() -> tables.Stack | str:
    """The GPU stack tables are named for: the installed runtime as `stratactl tables select`
    detects it, else the runtime torch was built with (a pip-installed torch brings its own);
    a message when there is none."""
    try:
        found = tables.detect(
            rocm_path=os.environ.get("ROCM_PATH"),
            cuda_path=os.environ.get("CUDA_HOME"),
            hsa_override=os.environ.get("HSA_OVERRIDE_GFX_VERSION"),
        )
        if found.stacks:
            return found.stacks[0]
        why = "; ".join(found.notes)
    except tables.TableError as err:
        why = str(err)
    import torch

    if not torch.cuda.is_available():
        return why
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        version = ".".join(torch.version.hip.split(".")[:3]).split("-")[0]
        name = f"{arch}-rocm-{version}.json"
    else:
        major, minor = torch.cuda.get_device_capability(0)
        name = f"sm{major}{minor}-cuda-{torch.version.cuda}.json"
    return tables.parse_name(name) or f"{why}; torch's runtime ({name[:-5]}) is not a table name"


def tuned(
    device_type: str,
    shapes: Mapping[str, int] | None = None,
    stack: tables.Stack | str | None = None,
    dirs: Sequence[Path] = tables.SEARCH_PATH,
) -> Lookup:
    """The table for the GPU this process runs on (`stack`, detected unless given), at the
    bucket nearest the model's `shapes`, with the line that says which (the caller logs it;
    on the CPU, the interpreter's settings, said at DEBUG)."""
    if device_type == "cpu":
        return Lookup(INTERPRETED, logging.DEBUG, "kernel tuning: the Triton interpreter's")
    stack = this_stack() if stack is None else stack
    if isinstance(stack, str):
        why = f"kernel tuning table: {stack}; {tables.COST}"
        return Lookup(KernelConfigs(), logging.INFO, why)
    return lookup(stack, shapes, dirs)


def kernel_configs(
    device_type: str,
    shapes: Mapping[str, int] | None = None,
    stack: tables.Stack | str | None = None,
    dirs: Sequence[Path] = tables.SEARCH_PATH,
) -> KernelConfigs:
    """The launch settings of `tuned`'s table, said in one line."""
    found = tuned(device_type, shapes, stack, dirs)
    log.log(found.level, "%s", found.message)
    return found.configs


BUILTIN = "builtin"  # a benchmark's --kernel-table for the built-in settings, no table


def configs_for_run(table: str | None, spec: ModelSpec, device_type: str = "cuda") -> KernelConfigs:
    """A benchmark's launch settings: those the daemon would pick for this model on this stack
    (`table` None), the built-in ones (`BUILTIN`), or a table file's."""
    if table is None:
        return kernel_configs(device_type, model_shapes(spec))
    if table == BUILTIN:
        return KernelConfigs()
    return load_configs(Path(table), model_shapes(spec))
