"""llama-server's native API: `/completion`'s requests and answers, `/infill`, the routes,
and the `timings` object (also on `/v1` answers that ask for it)."""
