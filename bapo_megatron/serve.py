"""`bapo-serve CONFIG [key=value ...] --index I`: rollout engine I of a job, in the foreground.

For engines on nodes of their own (slurm/bapo_32b.sh): each rollout node runs this with the
job's config; the trainer then connects with rollout.engines.urls. The engine is the one the
driver would start itself, with the same options (rollout.engines.kind, host, port + I, tensor
parallel, memory fraction, sampling seed, admin key from rollout.engines.admin_key_file or
$BAPO_ADMIN_API_KEY), serving model.hf_path; the trainer pushes its weights before the first
request, so a resumed job's engines never generate with the starting weights.

The process replaces itself with the server (exec), so Slurm's signals reach the server itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path


def engine_server(cfg, index: int, run_dir: Path):
    """The (not started) ServerProcess of engine `index` of the job `cfg`: its command, environment
    and URL."""
    from bapo_megatron.config.engines import DEFAULT_PORT
    from bapo_megatron.engines.sglang_launcher import Launch, ServedLoRA, admin_key, sglang_servers

    ro = cfg.rollout
    n = ro.engines.servers
    if not 0 <= index < n:
        raise ValueError(f"--index {index}: the job has rollout.engines.servers={n} engines (0..{n - 1})")
    if ro.engines.colocate:
        raise ValueError(
            "rollout.engines.colocate=true: colocated engines are started by the trainer itself, not bapo-serve"
        )
    if not cfg.model.hf_path:
        raise ValueError("model.hf_path: an engine needs the model's Hugging Face directory")
    if ro.engines.first_port is None:  # the trainer is handed the URLs: no free port, the fixed default
        ro = dataclasses.replace(ro, engines=dataclasses.replace(ro.engines, port=DEFAULT_PORT))
    run_dir.mkdir(parents=True, exist_ok=True)
    if ro.engines.kind == "sglang":
        from bapo_megatron.common.routes import recorded_routes
        from bapo_megatron.models.spec import ModelSpec

        spec = ModelSpec.from_hf_dir(cfg.model.hf_path)
        routes = recorded_routes(cfg, spec) is not None
        lora = ServedLoRA.of(spec, cfg.model.lora)
        launch = Launch(cfg.model.hf_path, seed=cfg.seed, routed_experts=routes, lora=lora)
        return sglang_servers(ro, launch, run_dir)[0][index]
    from bapo_megatron.engines.launcher import embedded_servers

    # beyond loopback: the job's shared key, or a refusal
    return embedded_servers(ro, cfg.model.hf_path, run_dir, cfg.seed, admin_key(ro, run_dir), host=ro.engines.host)[
        index
    ]


def wait_for_engines(urls: tuple[str, ...], timeout_s: float, poll_s: float = 2.0) -> int:
    """0 once every URL's /health answers 200; 2, naming those that never did, after timeout_s."""
    import time

    from bapo_megatron.engines.launcher import answers

    if not urls:
        raise ValueError("--wait: rollout.engines.urls is empty")
    waiting = list(urls)
    deadline = time.monotonic() + timeout_s
    while waiting:
        for url in list(waiting):
            if answers(url, timeout_s=5):
                waiting.remove(url)
                print(f"bapo-serve: {url} answers", file=sys.stderr, flush=True)
        if waiting and time.monotonic() > deadline:
            print(f"error: no answer from {', '.join(waiting)} within {timeout_s:.0f} s", file=sys.stderr)
            return 2
        if waiting:
            time.sleep(poll_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    from bapo_megatron.config import load_config
    from bapo_megatron.errors import ConfigError

    parser = argparse.ArgumentParser(
        prog="bapo-serve", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("args", nargs="+", metavar="CONFIG.yaml | key=value")
    parser.add_argument("--index", type=int, default=int(os.environ.get("SLURM_PROCID", "0")), help="engine number")
    parser.add_argument("--print-command", action="store_true", help="print the engine's command and URL; exit")
    parser.add_argument(
        "--wait",
        action="store_true",
        help="start nothing: wait until every rollout.engines.urls answers (at most rollout.engines.startup_timeout_s)",
    )
    args = parser.parse_args(argv)
    config, overrides = (args.args[0], args.args[1:]) if "=" not in args.args[0] else (None, args.args)
    try:
        cfg = load_config(config, overrides)
        if args.wait:
            return wait_for_engines(cfg.rollout.engines.urls, cfg.rollout.engines.startup_timeout_s)
        server = engine_server(cfg, args.index, cfg.run_path / "engines")
    except (ConfigError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.print_command:
        print(server.url)
        print(" ".join(server.command))
        return 0
    print(f"bapo-serve: engine {args.index} of {cfg.name} at {server.url}", file=sys.stderr, flush=True)
    os.execve(server.command[0], server.command, server.env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
