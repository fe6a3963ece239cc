"""Benchmark drivers; results are recorded as markdown under bench/results/."""
