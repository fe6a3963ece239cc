"""Benchmark drivers; results are recorded as markdown under bench/results/."""

from kernels.cpu_build import quiet_openmp

quiet_openmp()  # before a driver imports torch (see kernels/cpu_build.py)
