"""Kernel tooling: timing every kernel the offload engine launches at a model's shapes and
tuning their launch settings (`stratactl bench kernels`, `stratactl tune`)."""
