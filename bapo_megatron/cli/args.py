"""`bapo-train`'s command line: a config file, dotted overrides and the options, read into one namespace.

    args = parse_args(["job.yaml", "steps=3", "--dry-run"])   # args.config, args.overrides, args.dry_run

The overrides may come before or after the options; anything else after the config is refused.
"""

from __future__ import annotations

import argparse
import sys

USAGE = (
    "bapo-train [CONFIG.yaml] [key=value ...] [--dry-run] [--rollout-only] [--steps N] [--world-size N] "
    "[--gpu-memory-gib G]"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line's options (None: it had no arguments at all)."""
    parser = argparse.ArgumentParser(
        prog="bapo-train",
        usage=USAGE,
        description="BAPO reinforcement learning on Megatron-Core: rollout, rewards, policy update, weight sync.",
        epilog="Overrides are dotted config fields (algo.bapo.target_rho=0.4); --help-config lists them all. "
        "torchrun and srun start the same command on every rank. Relative paths, in the file or an "
        "override, resolve against the working directory: run the examples from the repository root.",
    )
    parser.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value", help="a YAML file, then overrides")
    parser.add_argument("--help-config", action="store_true", help="list every config field and exit")
    parser.add_argument("--dry-run", action="store_true", help="print what would run and the memory it needs; exit")
    parser.add_argument(
        "--rollout-only",
        action="store_true",
        help="generate and score only (verl's trainer.val_only, slime's debug rollout): the engines start "
        "from model.hf_path's weights and keep them; every sample goes to rollouts.jsonl and each step's reward "
        "mean, spread, positive share, flat groups and response lengths to metrics.jsonl, in "
        "<run_dir>/rollout_only; no trainer, optimizer or checkpoint. With --dry-run: its checks and plan",
    )
    parser.add_argument("--steps", type=int, metavar="N", help="the steps to run: the same as the override steps=N")
    parser.add_argument(
        "--world-size",
        type=int,
        help="the trainer processes --dry-run plans for (default: $WORLD_SIZE, else as the slurm/ script "
        "that runs the config does, found in the slurm/ folder nearest above the config or in $BAPO_HOME, "
        "else the fewest the layout needs, TP x PP x CP); the run itself takes its launcher's world",
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="GPU size for --dry-run (default 80: H100)")
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs of the driver's node for --dry-run (default 8)"
    )
    if argv is None:  # the command line, given nothing: the built-in defaults have no prompts
        parser.print_usage(sys.stderr)
        parser.exit(
            2,
            "bapo-train: give a config, e.g. `bapo-train examples/tiny_online.yaml` from the repository "
            "root (--help: the options; --help-config: every field)\n",
        )
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    args.config = args.args[0] if args.args and "=" not in args.args[0] else None
    args.overrides = args.args[1:] if args.config else args.args
    bad = [a for a in args.overrides if "=" not in a]
    if bad:
        parser.error(f"{bad[0]!r} is neither the config file (first) nor a key=value override")
    if args.steps is not None:
        args.overrides.append(f"steps={args.steps}")
    return args
