"""Strata kernels: quantized block formats, Triton kernels and their torch references."""
