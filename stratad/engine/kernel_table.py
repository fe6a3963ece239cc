"""Which launch settings the offload engine's kernels use: the tuning table that matches this
GPU stack exactly (`kernels.tables`), else the kernels' defaults. One log line at start says
which, and what a missing table costs."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from kernels import tables
from kernels.tuning import KernelConfigs, TuningTableError, load_configs

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


def kernel_configs(device_type: str) -> KernelConfigs:
    """The settings for the GPU this process runs on (defaults on the CPU, without a line)."""
    if device_type == "cpu":
        return KernelConfigs()
    try:
        found = tables.detect(
            rocm_path=os.environ.get("ROCM_PATH"),
            cuda_path=os.environ.get("CUDA_HOME"),
            hsa_override=os.environ.get("HSA_OVERRIDE_GFX_VERSION"),
        )
    except tables.TableError as err:
        log.warning("kernel tuning table: %s; %s", err, tables.COST)
        return KernelConfigs()
    if not found.stacks:
        log.warning("kernel tuning table: %s; %s", "; ".join(found.notes), tables.COST)
        return KernelConfigs()
    configs, level, message = configs_for(found.stacks[0])
    log.log(level, "%s", message)
    return configs
