"""The request runtime: job messages, the scheduler, and the generation loop over a runner.

`jobs` and `scheduler` are what the HTTP server and the control socket import (no torch).
`service.Engine` is what the scheduler's engine thread drives, one step at a time: it
tokenises and checks jobs and turns each step's outcomes into deltas. `generate`, `step`,
`step_plan` and `sequence` are the loop itself: each step plans which sequences compute what
(decodes, then prompt chunks under a token budget), runs one batched forward over them
(`stratad.engine`), then samples and updates each one (grammar masks with `grammar`,
`sampling`, stop conditions, prefix snapshots with `prefix`).
"""
