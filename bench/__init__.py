"""Benchmark drivers; results are recorded as markdown under bench/results/."""

from kernels.cpu.build import quiet_openmp

quiet_openmp()  # before a driver imports torch (see kernels/cpu/build.py)
