"""stratad: read the configuration, load the model, serve HTTP."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from stratad import __version__
from stratad.config import Config, ConfigError, load_config, override
from stratad.control.signals import StopSignals
from stratad.env import Env

log = logging.getLogger("stratad")

# A model or pack that cannot be served as it is (a damaged blob, an unsupported tensor type):
# EX_DATAERR. Restarting would fail the same way, so the unit's RestartPreventExitStatus lists it.
EXIT_BAD_MODEL = 65


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="stratad",
        description="Serve a (Mixture-of-Experts) language model over an OpenAI-compatible API.",
    )
    p.add_argument(
        "model",
        nargs="?",
        help="GGUF file or Hugging Face directory "
        "(default: the config's model.path, else SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--config",
        type=Path,
        help="TOML config file (default: $STRATA_CONFIG, "
        "else /etc/strata/stratad.toml if it exists)",
    )
    p.add_argument("--host", help="bind address (server.host)")
    p.add_argument("--port", type=int, help="TCP port (server.port)")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (engine.device)")
    p.add_argument(
        "--max-context", type=int, help="context tokens per sequence (model.max_context)"
    )
    p.add_argument("--control-socket", help="control socket path, empty for none (control.socket)")
    p.add_argument("--version", action="version", version=f"stratad {__version__}")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace, env: Env) -> Config:
    config = load_config(args.config, env)
    config = override(config, "model", path=args.model, max_context=args.max_context)
    config = override(config, "server", host=args.host, port=args.port)
    config = override(config, "control", socket=args.control_socket)
    return override(config, "engine", device=args.device)


def main(argv: list[str] | None = None) -> int:
    signals = StopSignals().install()  # a SIGTERM while starting is noted, not fatal
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
    from kernels.cpu.build import quiet_openmp

    quiet_openmp()  # before torch loads its OpenMP runtime (see kernels/cpu/build.py)
    from stratad.control.lifecycle import Operations
    from stratad.control.server import ControlError
    from stratad.model.spec import ModelError
    from stratad.runtime.service import Engine
    from stratad.server.app import Server
    from stratad.store.pack.manifest import PackError
    from stratad.store.placement.admission import AdmissionRefused

    if signals.requested:  # the imports take seconds: a stop may come before anything runs
        log.info("%s while starting: stopped before serving", signals.requested)
        return 0
    # Operations: control socket, systemd notify/watchdog, drain (stratad/control/lifecycle.py)
    ops = Operations(config, signals=signals)
    try:
        ops.start()
    except ControlError as e:
        log.error("%s", e)
        return 1
    # HTTP listens while the model loads (/health answers 503 until it is in)
    name = config.model.name or Path(config.model.path).name or None
    server = Server(config.server, model_name=name)
    ops.install(server)
    failed: list[BaseException] = []

    def load() -> Any:
        engine = Engine(config, on_pin_progress=ops.pin_progress_callback())
        ops.loaded(engine)
        return engine

    def load_failed(e: BaseException) -> None:
        if isinstance(e, AdmissionRefused):
            log.error("%s", e)
        elif isinstance(e, (ModelError, PackError, RuntimeError, OSError)):
            log.error("cannot load the model: %s", e)
        else:
            log.error("cannot load the model", exc_info=e)
        failed.append(e)
        ops.stop()

    server.load_in_background(load, load_failed)
    host, port = config.server.host, config.server.port
    try:
        ops.serve(server.app)
    except OSError as e:  # the port is taken, the address is not this host's or not a name
        log.error("cannot listen on %s:%d: %s", host, port, e.strerror or e)
        return _exit(server, 1)
    if failed:  # first: the load thread may not have ended yet (`server.loading` still true)
        # systemd: 75 (EX_TEMPFAIL) says "the host lacked the RAM the plan needs", not a bug.
        # At once: the load thread may still be unwinding inside torch, and the interpreter's
        # exit beside it can abort (a test saw the exit status lost on a loaded host).
        if isinstance(failed[0], AdmissionRefused):
            return _exit(server, failed[0].exit_code, now=True)
        bad = isinstance(failed[0], (ModelError, PackError))
        return _exit(server, EXIT_BAD_MODEL if bad else 1, now=True)
    if server.loading:
        log.info("stopped while the model was loading")
        return _exit(server, 0)
    if ops.forced:
        log.info("stopped (forced)")
        return _exit(server, 0, now=True)
    return 0


def _exit(server: Any, code: int, now: bool = False) -> int:
    """Exit with `code`; at once if the model still loads, since the interpreter's exit under a
    thread inside torch aborts the process (exit 134 instead of `code`), or when `now` (a forced
    stop, or a failed load: the interpreter's exit would wait for threads still at work)."""
    if server.loading or now:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
