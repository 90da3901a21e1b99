"""The `bapo-train` command line: its arguments, --help-config and --dry-run.

    bapo-train CONFIG.yaml [key=value ...]          # same as python -m bapo_megatron.train
    bapo-train --help-config                        # every field: type, default, what it does
    bapo-train CONFIG.yaml --dry-run [key=value]    # resolved config, layout, engines, memory; builds nothing

args.py reads the command line; fields.py lists the config's fields from the dataclasses and their
field docstrings; dry_run.py and dry_run_memory.py say what a run would do, planned as the run
plans (plan.py); slurm.py finds the Slurm script that runs a config, whose world the dry run plans
for; rank_errors.py says a config error every rank makes once a node. Launching is train.main's.
"""

from bapo_megatron.cli.args import parse_args
from bapo_megatron.cli.dry_run import dry_run, dry_run_command
from bapo_megatron.cli.dry_run_memory import GIB
from bapo_megatron.cli.fields import config_fields, help_config

__all__ = ["GIB", "config_fields", "dry_run", "dry_run_command", "help_config", "parse_args"]
