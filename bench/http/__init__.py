"""Benchmarks over HTTP against a `stratad` of their own: clients, speculation, API fuzzing."""
