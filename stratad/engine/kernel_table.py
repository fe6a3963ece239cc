"""Which launch settings the offload engine's kernels use: the tuning table that matches this
GPU stack exactly (`kernels.tables`), else the kernels' defaults. One log line at start says
which, and what a missing table costs."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from kernels import tables
from kernels.tuning import INTERPRETED, KernelConfigs, TuningTableError, load_configs

log = logging.getLogger("stratad.engine")


def configs_for(
    stack: tables.Stack, dirs: Sequence[Path] = tables.SEARCH_PATH
) -> tuple[KernelConfigs, int, str]:
    """(settings, log level, message) for one stack: a pure function of the tables in `dirs`."""
    choice = tables.select(stack, dirs)
    if choice.path is None:
        return KernelConfigs(), logging.WARNING, choice.message
    try:
        configs = load_configs(choice.path)
    except TuningTableError as err:
        return KernelConfigs(), logging.WARNING, f"{err}: refused; {tables.COST}"
    return configs, logging.INFO, f"kernel tuning table {choice.message}"


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


def kernel_configs(device_type: str) -> KernelConfigs:
    """The settings for the GPU this process runs on (on the CPU, the interpreter's, without
    a line)."""
    if device_type == "cpu":
        return INTERPRETED
    stack = this_stack()
    if isinstance(stack, str):
        log.warning("kernel tuning table: %s; %s", stack, tables.COST)
        return KernelConfigs()
    configs, level, message = configs_for(stack)
    log.log(level, "%s", message)
    return configs
