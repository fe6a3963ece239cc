"""The request runtime: job messages, the scheduler and the generation loop.

`jobs` and `scheduler` are what the HTTP server and the control socket import (no torch);
`sequence`, `step` and `generate` are the generation loop the engine thread runs: each
step schedules the sequences to advance, runs one batched forward over them, then samples
and updates each one (stop conditions, the text to stream).
"""
