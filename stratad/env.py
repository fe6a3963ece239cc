"""Every STRATA_* environment variable, typed, read in this one place.

Other modules never touch os.environ for STRATA_* names: they take an `Env` (or the config
built from it) as an argument.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields


def _bool(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Env:
    config: str | None = None
    """STRATA_CONFIG: path of the TOML config file (default /etc/strata/stratad.toml if present)."""
    model: str | None = None
    """STRATA_MODEL: model path (GGUF file or Hugging Face directory); overrides the config."""
    log_level: str | None = None
    """STRATA_LOG_LEVEL: DEBUG, INFO, WARNING or ERROR; overrides the config."""
    device: str | None = None
    """STRATA_DEVICE: cpu, cuda, cuda:N or auto; overrides the config."""
    control_socket: str | None = None
    """STRATA_CONTROL_SOCKET: path of the control socket; overrides control.socket (stratad and
    stratactl)."""
    resident_headroom_gib: float | None = None
    """STRATA_RESIDENT_HEADROOM_GIB: RAM left to the host when sizing the resident set."""
    synth_tokenizer: str | None = None
    """STRATA_SYNTH_TOKENIZER: GGUF whose tokenizer synthetic models borrow (default SmolLM2's)."""
    decode_timing: bool = False
    """STRATA_DECODE_TIMING: log per-request stage timings."""

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Env:
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = environ.get(f"STRATA_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            kind = str(f.type)
            try:
                if "float" in kind:
                    values[f.name] = float(raw)
                elif "bool" in kind:
                    values[f.name] = _bool(raw)
                else:
                    values[f.name] = raw
            except ValueError:
                raise ValueError(f"STRATA_{f.name.upper()}={raw!r}: expected a {kind}") from None
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def documented(cls) -> list[tuple[str, str]]:
        """(variable, description) for the configuration reference."""
        import inspect

        src = inspect.getsource(cls)
        out = []
        for f in fields(cls):
            marker = f"    {f.name}:"
            doc = src.split(marker, 1)[1].split('"""', 2)[1] if marker in src else ""
            out.append((f"STRATA_{f.name.upper()}", doc.split(":", 1)[-1].strip()))
        return out
