"""Benchmarks of the host side: the `cpu` engine and its expert kernels, less RAM, the RAM tier."""
