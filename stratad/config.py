"""The configuration: one frozen chain of typed sections.

Sources, later ones winning: defaults, the TOML file, STRATA_* environment variables (read by
`stratad.env`), the command line. msgspec validates types and rejects unknown keys, so a typo
in the file is an error at start, not a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from stratad.env import Env

DEFAULT_CONFIG_PATH = Path("/etc/strata/stratad.toml")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key."""


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    path: str = ""
    """GGUF file or Hugging Face directory; empty serves the default model (SmolLM2-135M-Instruct)."""
    name: str = ""
    """Model id shown by /v1/models; empty uses the file name."""
    max_context: int = 4096
    """Tokens of context per sequence (prompt plus completion); capped by the model's own."""


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    """Bind address of the HTTP server."""
    port: int = 8080
    """TCP port of the HTTP server."""
    api_key: str = ""
    """If set, requests need `Authorization: Bearer <api_key>`."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest accepted request body."""


class EngineConfig(_Section):
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (the first GPU if there is one)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype; auto is float32 on the CPU and bfloat16 on a GPU."""
    threads: int = 0
    """CPU threads for torch; 0 leaves torch's default."""


class LogConfig(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level."""


class Config(_Section):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)


def parse_config(text: str, source: str = "<config>") -> Config:
    try:
        return msgspec.toml.decode(text, type=Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None


def load_config(path: Path | None, env: Env) -> Config:
    """The file (if any) with the environment's overrides applied."""
    if path is None and env.config:
        path = Path(env.config)
    if path is None and DEFAULT_CONFIG_PATH.is_file():
        path = DEFAULT_CONFIG_PATH
    config = Config()
    if path is not None:
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from None
        config = parse_config(text, str(path))
    return apply_env(config, env)


def apply_env(config: Config, env: Env) -> Config:
    if env.model:
        config = msgspec.structs.replace(
            config, model=msgspec.structs.replace(config.model, path=env.model)
        )
    if env.device:
        config = msgspec.structs.replace(
            config, engine=msgspec.structs.replace(config.engine, device=env.device)
        )
    if env.log_level:
        level = env.log_level.upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"STRATA_LOG_LEVEL={env.log_level!r}: expected DEBUG/INFO/WARNING/ERROR")
        config = msgspec.structs.replace(config, log=LogConfig(level=level))  # type: ignore[arg-type]
    return config


def override(config: Config, section: str, **values: object) -> Config:
    """A copy with some keys of one section replaced (command-line flags)."""
    values = {k: v for k, v in values.items() if v is not None}
    if not values:
        return config
    current = getattr(config, section)
    try:
        updated = msgspec.convert(msgspec.structs.asdict(current) | values, type=type(current))
    except msgspec.ValidationError as e:
        raise ConfigError(f"[{section}] {e}") from None
    return msgspec.structs.replace(config, **{section: updated})
