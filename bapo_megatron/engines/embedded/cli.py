"""python -m bapo_megatron.engines.embedded: the embedded engine's command line (keys, model checks, options)."""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import math
import os
import signal
import socket
import sys
from pathlib import Path

import torch

from bapo_megatron.engines.embedded import server as embedded_server
from bapo_megatron.engines.embedded.core import EngineCore
from bapo_megatron.engines.embedded.server import EmbeddedServer
from bapo_megatron.engines.launcher import is_loopback

DTYPES = ("float32", "bfloat16")
"""The dtypes the embedded engine runs in (rollout.engines.dtype; its "auto" is float32 here)."""


def _key(env: str, file: str | None) -> str | None:
    """A key from its file, else from $env; None when neither is given. A key file or variable
    that is given but empty or blank is an error: taken as no key, it would turn auth off."""
    if file:
        key, source = Path(file).read_text().strip(), f"key file {file}"
    elif env in os.environ:
        key, source = os.environ[env].strip(), f"${env}"
    else:
        return None
    if not key:
        raise ValueError(f"{source} is empty: set a key, or leave it out to run without one on loopback")
    return key


def _model_dir_problem(model: Path) -> str | None:
    """What keeps `model` from being served (checked before the model is built), or None."""
    if not model.is_dir():
        return "no such directory"
    if not (model / "config.json").is_file():
        return "no config.json (a Hugging Face model directory is needed)"
    if not any(model.glob("*.safetensors")):
        return "no *.safetensors weights (only safetensors are read, never pickles)"
    from bapo_megatron.common.hf_io import HFCheckpoint

    try:
        HFCheckpoint(model)  # every tensor config.json implies, with its shape, in floating point
    except (ValueError, KeyError, OSError) as err:
        return str(err)
    return None


def _in_range(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside [{low}, {high}]")
        return value

    return parse


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number >= 0")
    return value


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _write_port(path: Path, port: int) -> None:
    """The port, written whole (renamed into place): a reader never sees half of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(f"{port}\n")
    os.replace(partial, path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bapo_megatron.engines.embedded",
        description=embedded_server.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="HF model directory (safetensors)")
    parser.add_argument("--port", type=_in_range(0, 65535), required=True, help="0: a free port (see --port-file)")
    parser.add_argument(
        "--port-file", help="write the port listened on to this file once listening (with --port 0: the one it got)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch", type=_in_range(1, 1 << 16), default=64, help="requests decoded together")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the weights' and activations' dtype (bfloat16: as a GPU engine runs; weights are cast as loaded)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every request alone in its forwards: its output never depends on what else runs (deterministic runs)",
    )
    parser.add_argument(
        "--log-interval",
        type=_non_negative,
        default=30.0,
        help="seconds between throughput lines on stderr while busy (0: none)",
    )
    parser.add_argument(
        "--request-timeout",
        type=_non_negative,
        default=60.0,
        help="seconds a client has to send a request's headers and body (slow clients hold a connection each)",
    )
    parser.add_argument("--admin-api-key-file", help="file holding the admin key (else $BAPO_ADMIN_API_KEY)")
    parser.add_argument("--api-key-file", help="file holding the API key (else $BAPO_API_KEY)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        admin_key = _key("BAPO_ADMIN_API_KEY", args.admin_api_key_file)
        api_key = _key("BAPO_API_KEY", args.api_key_file)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and admin_key is None:
        print(
            f"error: --host {args.host} is not loopback: set an admin key (BAPO_ADMIN_API_KEY or "
            "--admin-api-key-file) so that weight updates and pauses are protected",
            file=sys.stderr,
        )
        return 2
    problem = _model_dir_problem(Path(args.model))
    if problem:
        print(f"error: --model {args.model}: {problem}", file=sys.stderr)
        return 2
    _serve(args, api_key, admin_key)
    return 0


def _serve(args: argparse.Namespace, api_key: str | None, admin_key: str | None) -> None:
    """Build the engine on its own thread, bind the socket, report the port, and serve until stopped."""
    from aiohttp import web

    # Slurm's warning signal (SIGUSR1) is for the driver, which saves and then stops its engines
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    engine_thread = concurrent.futures.ThreadPoolExecutor(1, "engine")  # the model is built where it will run
    dtype = getattr(torch, args.dtype)
    core = engine_thread.submit(EngineCore, args.model, args.seed, args.max_batch, args.batch_invariant, dtype).result()
    server = EmbeddedServer(core, api_key, admin_key, engine_thread, args.log_interval, args.request_timeout)
    # what start-up made (transformers, torch, the model) lives as long as the engine: out of the
    # collector's full passes, which walked all of it mid-rollout (0.2-1 s each on a loaded machine)
    gc.freeze()
    # bound here (port 0: the kernel's free port), reported through the port file, then served
    sock = socket.create_server((args.host, args.port), family=_family(args.host))
    if args.port_file:
        _write_port(Path(args.port_file), sock.getsockname()[1])
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request;
    # keepalive_timeout also closes a connection that has not sent its request's headers by then
    web.run_app(
        server.app(),
        sock=sock,
        print=None,
        access_log=None,
        handler_cancellation=True,
        keepalive_timeout=args.request_timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
