"""stratad: read the configuration, load the model, serve HTTP."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from stratad import __version__
from stratad.config import Config, ConfigError, load_config, override
from stratad.env import Env

log = logging.getLogger("stratad")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="stratad",
        description="Serve a (Mixture-of-Experts) language model over an OpenAI-compatible API.",
    )
    p.add_argument("model", nargs="?", help="GGUF file or Hugging Face directory "
                   "(default: the config's model.path, else SmolLM2-135M-Instruct)")
    p.add_argument("--config", type=Path, help="TOML config file (default: $STRATA_CONFIG, "
                   "else /etc/strata/stratad.toml if it exists)")
    p.add_argument("--host", help="bind address (server.host)")
    p.add_argument("--port", type=int, help="TCP port (server.port)")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (engine.device)")
    p.add_argument("--max-context", type=int, help="context tokens per sequence (model.max_context)")
    p.add_argument("--version", action="version", version=f"stratad {__version__}")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace, env: Env) -> Config:
    config = load_config(args.config, env)
    config = override(config, "model", path=args.model, max_context=args.max_context)
    config = override(config, "server", host=args.host, port=args.port)
    return override(config, "engine", device=args.device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        env = Env.read()
        config = build_config(args, env)
    except (ConfigError, ValueError) as e:
        print(f"stratad: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from aiohttp import web

    from stratad.engine.service import Engine
    from stratad.model.spec import ModelError
    from stratad.server.app import Server

    try:
        engine = Engine(config)
    except (ModelError, RuntimeError, OSError) as e:
        log.error("cannot load the model: %s", e)
        return 1
    server = Server(engine, config.server.max_body_bytes)
    log.info("serving %s on http://%s:%d", engine.model_id, config.server.host, config.server.port)
    web.run_app(server.app, host=config.server.host, port=config.server.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
